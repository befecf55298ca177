"""Files written so that a crash or a full disk never leaves half of one: `atomic_write`
(temp file beside the target, fsync, rename, folder fsync) and `disk_error`, which says
"no space left on device" with the path even when the writer hides it. Free of torch, so
that the scheduler's service uses the same writer as checkpoints and model folders."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

_COUNTER = itertools.count()


def umask() -> int:
    """The process's umask, read without changing it (Linux), else by setting it back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    m = os.umask(0o022)
    os.umask(m)
    return m


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not fsync folders
    finally:
        os.close(fd)


def _disk_full(folder: Path) -> bool:
    import shutil

    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def disk_error(e: BaseException, path) -> BaseException:
    """An error while writing `path` as the user should read it: a full disk or quota says
    so with the path (also when the writer hides it, as torch.save's 'unexpected pos 832 vs
    726' does: then the free space decides); an OSError without a file name gets the path."""
    import errno

    no_space = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or \
        any(s in str(e) for s in ("No space left", "StorageFull", "Disk quota exceeded"))
    if not no_space and isinstance(e, (OSError, RuntimeError)) and not isinstance(e, FileNotFoundError):
        no_space = _disk_full(Path(path).parent)
    if no_space:
        return OSError(errno.ENOSPC, f"no space left on device while writing {path}")
    if isinstance(e, OSError) and e.filename is None:
        return OSError(e.errno, f"{e.strerror or e} while writing {path}")
    return e


def atomic_write(path: str | Path, write: Callable[[Path], object], mode: int | None = None) -> None:
    """Replace `path` atomically: `write(tmp)` fills a temp file beside it, which is fsynced,
    given `mode`, by default the one the umask asks for (0666 & ~umask; safetensors creates 0600), and renamed
    over `path`; the folder is fsynced. On any error the temp file is removed and `path` is
    as it was; a full disk raises OSError(ENOSPC, 'no space left on device while writing PATH')."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{next(_COUNTER)}"
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.fchmod(fd, (0o666 & ~umask()) if mode is None else mode)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        err = disk_error(e, path)
        if err is e:
            raise
        raise err from e
    fsync_dir(path.parent)
