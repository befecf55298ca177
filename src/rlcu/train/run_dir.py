"""The run folder (log.out_dir) of a fresh run: it must not hold another run, whose
metrics.jsonl would be overwritten, whose TensorBoard events would mix with the new ones
and whose checkpoints a later `--resume auto` would take. A fresh run into a folder that
holds one is refused with one line unless log.overwrite (`--overwrite`) is set; then the
earlier run's files (those a run writes: metrics, logs, configs, events, plots, the W&B run
id, and the checkpoints, with the temp and shard folders of killed saves, under
checkpoint.dir and under <out_dir>/checkpoints) are removed first, and nothing else.

checkpoint.resume: auto with no checkpoint to resume restarts a run killed before its first
checkpoint (its steps are computed again, as a resume recomputes those after its
checkpoint: metrics.jsonl is started anew, log.txt continues). Nothing else is taken for
such a run without --overwrite: a finished run, or one whose config.yaml names another
checkpoint.dir or that logged steps past its first checkpoint, is refused with one line.

`check_writable` is the start's check that the run folder and the checkpoint root can be
written (a path that is a file, no permission, a full disk), one line and exit 2 at the
start rather than a traceback at the first write."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import yaml

from rlcu.errors import SetupError

RUN_FILES = ("metrics.jsonl", "config.yaml", "config.resume-step-*.yaml", "log.txt", "events.out.tfevents.*",
             "*_curve.png", "curves.png", "wandb_run_id", "wandb_run_id.tmp")
# what a save leaves under the checkpoint root: complete checkpoints, and the temp folders
# (.tmp-step-*, .tmp-old-step-*) and rank shard folders (.shards-step-*) of a killed one
CKPT_PREFIXES = ("step-", ".tmp-", ".shards-")


def _ckpt_dirs(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(CKPT_PREFIXES))


def earlier_run(out_dir: Path, ckpt_root: Path) -> list[Path]:
    """The files and checkpoint folders of a run already in out_dir / ckpt_root (and in
    <out_dir>/checkpoints, where a run with another checkpoint.dir left its own)."""
    found = [p for pat in RUN_FILES for p in sorted(out_dir.glob(pat))] if out_dir.is_dir() else []
    roots = [ckpt_root] + [r for r in (out_dir / "checkpoints",) if r.resolve() != ckpt_root.resolve()]
    return found + [d for r in roots for d in _ckpt_dirs(r)]


def _last_logged(out_dir: Path) -> int | None:
    """The highest step in out_dir/metrics.jsonl (None: no row)."""
    f = out_dir / "metrics.jsonl"
    last = None
    try:
        lines = f.read_text().splitlines() if f.is_file() else []
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        try:
            last = max(last or 0, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError, TypeError):  # a line torn by a kill mid-write
            continue
    return last


def _not_a_restart(out_dir: Path, ckpt_root: Path) -> str | None:
    """Why the run in out_dir, with no checkpoint under ckpt_root, is not one killed before
    its first checkpoint (which --resume auto restarts); None when it is."""
    last = _last_logged(out_dir)
    try:
        cfg = yaml.safe_load((out_dir / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        cfg = None
    if not isinstance(cfg, dict):
        return None if last is None else f"it logged step {last} and has no readable config.yaml"
    ck = cfg.get("checkpoint") if isinstance(cfg.get("checkpoint"), dict) else {}
    its_root = Path(ck["dir"]) if ck.get("dir") else out_dir / "checkpoints"
    if its_root.resolve() != ckpt_root.resolve():
        return (f"its checkpoints go to {its_root} (checkpoint.dir in its config.yaml), not {ckpt_root}: "
                f"resume it with --set checkpoint.dir={its_root}")
    steps, every = cfg.get("steps"), ck.get("every")
    if last is not None and isinstance(steps, int) and last >= steps:
        return f"it finished ({last} of {steps} steps) and left no checkpoint under {ckpt_root}"
    if last is not None and isinstance(every, int) and 0 < every < last:
        return (f"it logged step {last}, past its first checkpoint (step {every}), but {ckpt_root} holds no "
                f"checkpoint (moved or deleted?)")
    return None


def claim(out_dir, ckpt_root, *, overwrite: bool, auto: bool = False) -> str:
    """Make out_dir ready for a fresh run (see the module docstring); returns a description of
    what was removed ('' if nothing)."""
    out_dir, ckpt_root = Path(out_dir), Path(ckpt_root)
    old = earlier_run(out_dir, ckpt_root)
    if not old:
        return ""
    has_run = any(p.name in ("metrics.jsonl", "config.yaml") or p.name.startswith("step-") for p in old)
    restart = has_run and auto and not overwrite
    if has_run and not (overwrite or auto):
        names = ", ".join(str(p.relative_to(out_dir)) if p.is_relative_to(out_dir) else str(p) for p in old[:3])
        more = f" and {len(old) - 3} more" if len(old) > 3 else ""
        raise SetupError(f"log.out_dir {out_dir} already holds a run ({names}{more}): continue it with --resume auto "
                         f"(checkpoint.resume: auto), replace it with --overwrite (log.overwrite: true), or choose "
                         f"another log.out_dir")
    if restart and (why := _not_a_restart(out_dir, ckpt_root)):
        raise SetupError(f"log.out_dir {out_dir} holds a run that --resume auto cannot continue: {why}; replace it "
                         f"with --overwrite (log.overwrite: true), or choose another log.out_dir")
    if restart:
        old = [p for p in old if p.name != "log.txt"]  # the restarted run's log goes on after the killed one's
    for p in old:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    n_ck = sum(1 for p in old if p.is_dir())
    return f"{len(old) - n_ck} files, {n_ck} checkpoints" + (", stopped before its first checkpoint" if restart else "")


def check_writable(*folders) -> None:
    """Each folder is a folder (or can be made: its nearest existing parent is one) and takes
    a file: else one line (SetupError) naming the path and why (a file in the way, no
    permission, a full disk). Nothing is left behind: no folder is made, the probe removed."""
    for d in map(Path, folders):
        at = d
        while not at.exists() and at.parent != at:
            at = at.parent
        if not at.is_dir():
            raise SetupError(f"{d}: cannot write the run's files there: {at} is a file, not a folder")
        probe = at / f".rlcu-write-test-{os.getpid()}"
        try:
            with open(probe, "wb") as fh:  # a full disk may still make a file: write and sync some bytes
                fh.write(bytes(4096))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as e:
            raise SetupError(f"{d}: cannot write the run's files there: {_why(e)}") from None
        finally:
            try:
                probe.unlink(missing_ok=True)
            except OSError:
                pass


def _why(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device (or the disk quota is used up)"
    return (e.strerror or str(e)).lower()  # the probe's own name says nothing to the user
