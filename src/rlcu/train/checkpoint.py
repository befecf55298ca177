"""Checkpoints: atomic, resumable, pruned; and building a run's model from its config.

Layout of one checkpoint, `root/step-000123/`:
    model/              the weights as an HF folder (config.json + safetensors, tokenizer files)
    optim.pt            optimizer state: step count, m, v (and the fp32 master weights when
                        the working weights are bf16)
    <name>.pt           extra state_dict()s (e.g. a critic and its optimizer)
    rng.pt              Python, NumPy, torch CPU/CUDA and named torch.Generator RNG states
    trainer_state.json  step, the kind of trainer, the run's config, data position, metrics
                        tail, whatever the trainer adds (resume checks the kind, the model
                        and the settings against the run's: rlcu.train.resume)

Atomicity: everything is written into `root/.tmp-step-000123-<pid>/`, every file and folder
is fsynced, then the folder is renamed to its final name (a rename within one file system is
atomic) and the root is fsynced. A kill at any moment leaves either no new folder or a
complete one, so the previous checkpoint stays loadable; stale temp folders (and the rank
shard folders of a killed sharded save, rlcu.parallel.ckpt) are removed by the next save, at any
number of ranks. A full disk (or quota) fails the save with OSError(ENOSPC) naming the file
and the checkpoint that is still intact (torch.save's own error, "unexpected pos", hides it),
nothing of the new step left behind. Set RLCU_CHECKPOINT_TEST_SLEEP=<seconds> to sleep
between files (tests kill a save midway with it).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from rlcu import files
from rlcu.model import io

_STEP_RE = re.compile(r"^step-(\d+)$")


def _test_sleep() -> None:
    s = os.environ.get("RLCU_CHECKPOINT_TEST_SLEEP")
    if s:
        time.sleep(float(s))


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), key=lambda q: -len(q.parts)):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [p for p in path.rglob("*") if p.is_dir()] + [path]:
        files.fsync_dir(d)


# ---------------------------------------------------------------- RNG states
def rng_state(generators: dict | None = None) -> dict:
    d = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        d["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        d["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    d["generators"] = {k: g.get_state() for k, g in (generators or {}).items()}
    return d


def set_rng_state(d: dict, generators: dict | None = None) -> None:
    random.setstate(_tuplify(d["python"]))
    torch.set_rng_state(d["torch"])
    if "cuda" in d and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["cuda"])
    if "numpy" in d:
        import numpy as np

        name, keys, pos, has_gauss, cached = d["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    for k, g in (generators or {}).items():
        if k in d.get("generators", {}):
            g.set_state(d["generators"][k])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- save / find / load
def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "trainer_state.json").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(root, step: int, model, optimizer, state: dict, keep_last: int, *,
                    extra: dict | None = None, generators: dict | None = None, tokenizer=None) -> Path:
    """Write root/step-{step:06d}/ atomically and keep it and the newest `keep_last` - 1
    checkpoints of earlier steps (0: keep all); checkpoints of later steps (another branch of
    the run) are never pruned, and the one just written never is.
    `state` must be JSON-serialisable; `extra` maps names to objects with state_dict();
    `generators` maps names to torch.Generators whose states are saved; `tokenizer` (with
    save_pretrained) is written into model/. Returns the folder."""
    if getattr(optimizer, "sharded", False):  # data parallel: every rank writes its shard (rlcu.parallel.ckpt)
        from rlcu.parallel.ckpt import save_sharded

        return save_sharded(root, step, model, optimizer, state, keep_last, extra=extra, generators=generators,
                            tokenizer=tokenizer)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        state_json = json.dumps({**state, "step": int(step)}, indent=1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint trainer state must be JSON-serialisable: {e}") from None
    _recover(root)
    _clear_killed_saves(root, keep=getattr(optimizer, "folder", None))
    name = f"step-{int(step):06d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp / "model")
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp / "model")
        _test_sleep()
        if hasattr(optimizer, "write_into"):  # the ranks' optimizer shards (rlcu.parallel.ckpt)
            optimizer.write_into(tmp)
        elif optimizer is not None:
            write_file(tmp / "optim.pt", lambda p: torch.save(optimizer.state_dict(), p))
            _test_sleep()
        for k, obj in (extra or {}).items():
            write_file(tmp / f"{k}.pt", lambda p, obj=obj: torch.save(obj.state_dict(), p))
        write_file(tmp / "rng.pt", lambda p: torch.save(rng_state(generators), p))
        _test_sleep()
        write_file(tmp / "trainer_state.json", lambda p: p.write_text(state_json))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. an abort right after a periodic save)
            old = root / f".tmp-old-{name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        files.fsync_dir(root)
    except BaseException as e:
        err = files.disk_error(e, tmp) if isinstance(e, (OSError, RuntimeError)) and not no_space(e) else e
        shutil.rmtree(tmp, ignore_errors=True)  # after disk_error: a full disk is told by its free space
        if no_space(err):
            err = not_written(err, root, name)
        if err is e:
            raise
        raise err from e
    if keep_last > 0:  # the newest keep_last - 1 of the earlier steps stay beside this one
        older = [p for s, p in _step_dirs(root) if s < int(step)]
        for p in older[: max(len(older) - (keep_last - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def not_written(e: OSError, root: Path, name: str) -> OSError:
    """A full disk's error during the save of checkpoint `name`, with the one still there."""
    prev = latest_checkpoint(root)
    return OSError(e.errno, f"{e.strerror}: checkpoint {name} not written; "
                            + (f"the last checkpoint, {prev}, is intact" if prev else "no earlier checkpoint"))


def write_file(path: Path, write) -> None:
    """write(path), its errors as files.disk_error tells them: a full disk says so with the path
    (torch.save reports ENOSPC as a RuntimeError 'unexpected pos ...')."""
    try:
        write(path)
    except (OSError, RuntimeError) as e:
        err = files.disk_error(e, path)
        if err is e:
            raise
        raise err from e


def _clear_killed_saves(root: Path, keep: Path | None = None) -> None:
    """Remove what killed saves left: temp folders, and the rank shard folders of a sharded
    save (also when this run has another number of ranks, or one process); `keep`: the shard
    folder of the save in progress."""
    for p in [*root.glob(".tmp-*"), *root.glob(".shards-*")]:
        if keep is None or p.resolve() != Path(keep).resolve():
            shutil.rmtree(p, ignore_errors=True)


def _recover(root: Path) -> None:
    """A save killed between moving an old step-N aside and renaming the new one in leaves
    both complete but hidden: put the old one back."""
    for p in root.glob(".tmp-old-step-*"):
        name = p.name[len(".tmp-old-"):].rsplit("-", 1)[0]
        if not (root / name).exists() and (p / "trainer_state.json").exists():
            p.rename(root / name)


def latest_checkpoint(root) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    dirs = _step_dirs(Path(root))
    return dirs[-1][1] if dirs else None


def resolve_resume(resume: str | None, root) -> Path | None:
    """checkpoint.resume -> a checkpoint folder or None. 'auto' takes the newest under
    `root` (None if there is none yet); a path may be a checkpoint or a root of them."""
    if resume is None:
        return None
    if resume == "auto":
        if Path(root).is_dir():
            _recover(Path(root))
        return latest_checkpoint(root)
    p = Path(resume)
    if (p / "trainer_state.json").exists():
        return p
    if p.is_dir():
        last = latest_checkpoint(p)
        if last is not None:
            return last
    raise FileNotFoundError(f"checkpoint.resume: {resume} is not a checkpoint folder (no trainer_state.json) "
                            f"nor a folder of step-* checkpoints")


def load_checkpoint(path, model, optimizer, *, extra: dict | None = None, generators: dict | None = None,
                    restore_rng: bool = True) -> dict:
    """Load weights into `model.flat`, the optimizer state, extra state_dicts and RNG states
    from a checkpoint folder; return its trainer state (a dict with at least 'step')."""
    path = Path(path)
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"{path}: not a checkpoint (no trainer_state.json)")
    io.load_into(path / "model", model.layout, model.flat)
    if optimizer is not None:  # optim.pt, or the shards of any number of ranks
        from rlcu.parallel.ckpt import load_optimizer

        load_optimizer(path, optimizer)
    for k, obj in (extra or {}).items():
        if getattr(obj, "sharded", False) or (path / k).is_dir():  # an optimizer's shards (rlcu.parallel.ckpt)
            from rlcu.parallel.ckpt import load_optimizer

            load_optimizer(path, obj, k)
            continue
        f = path / f"{k}.pt"
        if not f.exists():
            raise FileNotFoundError(f"{path}: no {k}.pt")
        obj.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    if restore_rng and (path / "rng.pt").exists():
        set_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=True), generators)
    return json.loads((path / "trainer_state.json").read_text())


# ---------------------------------------------------------------- a run's model
def build_model(cfg, device: str | None = None, dtype: torch.dtype | None = None):
    """A Qwen3 from a ModelConfig: loaded from `cfg.path`, or made from scratch from the
    Qwen3Config fields in `cfg.tiny` (seeded by cfg.init_seed)."""
    from rlcu.config import ConfigError
    from rlcu.model.config import Qwen3Config
    from rlcu.model.qwen3 import Qwen3

    device = device or cfg.resolve_device()
    dtype = dtype or cfg.resolve_dtype()
    if cfg.path is not None:
        from rlcu.hub import model_folder

        model = Qwen3.from_pretrained(model_folder(cfg.path, cfg.revision, "model.path"), device=device, dtype=dtype)
    elif cfg.tiny is not None:
        names = set(Qwen3Config.__dataclass_fields__)
        bad = [k for k in cfg.tiny if k not in names]
        if bad:
            raise ConfigError(f"model.tiny.{bad[0]}", f"is not a Qwen3Config field (known: {', '.join(sorted(names))})")
        try:
            qc = Qwen3Config(**cfg.tiny)
        except ValueError as e:
            raise ConfigError("model.tiny", f"is invalid: {e}") from None
        model = Qwen3.from_config(qc, device=device, dtype=dtype, seed=cfg.init_seed)
    else:
        raise ConfigError("model.path", "must be set (or model.tiny for a model made from scratch)")
    cfg.check_layers(model.cfg.num_hidden_layers)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    return model
