"""Checkpoints: atomic, resumable, pruned; and building a run's model from its config.

Layout of one checkpoint, `root/step-000123/`:
    model/              the weights as an HF folder (config.json + safetensors, tokenizer files);
                        a LoRA run's: the base's config.json and the adapters as a PEFT folder
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
shard folders of a killed sharded save) are removed by the next save, at any number of ranks.
A full disk (or quota) fails the save with OSError(ENOSPC) naming the file and the checkpoint
that is still intact (torch.save's own error, "unexpected pos", hides it), nothing of the new
step left behind. Set RLCU_CHECKPOINT_TEST_SLEEP=<seconds> to sleep between files (tests kill
a save midway with it).

This module is the one writer of checkpoints. Across ranks it follows the sharded strategy of
rlcu.parallel.ckpt (which rank writes which optimizer shard, where the ranks wait), and loads
an optimizer's state through its reader (shards of any number of ranks, or optim.pt).
"""

from __future__ import annotations

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
from rlcu.config import ConfigError
from rlcu.errors import no_space
from rlcu.hub import model_folder
from rlcu.model import io
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.parallel.ckpt import load_optimizer, sharded_save

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
    save_pretrained) is written into model/. Returns the folder.
    With a sharded optimizer every rank calls it: the strategy of rlcu.parallel.ckpt
    (`sharded_save`) says which shard files each rank writes and where the ranks wait; rank 0
    writes the rest and renames the whole in."""
    root = Path(root)
    try:
        state_json = json.dumps({**state, "step": int(step)}, indent=1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint trainer state must be JSON-serialisable: {e}") from None
    step, name = int(step), f"step-{int(step):06d}"
    plan = sharded_save(optimizer, extra)
    if plan is None:
        return _write_step(root, step, state_json, model, optimizer, extra, keep_last, generators, tokenizer)
    shards = root / f".shards-{name}"
    if plan.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        _clear_killed_saves(root)
        for k in plan.names:
            (shards / k).mkdir(parents=True)
    plan.sync()
    for k, fname, obj in plan.files():
        try:
            files.atomic_write(shards / k / fname, lambda p, obj=obj: torch.save(obj.state_dict(), p))
        except OSError as e:  # the shards folder itself: the next save clears it, at any number of ranks
            if not no_space(e):
                raise
            raise not_written(e, root, name) from e
    plan.sync()
    out = root / name
    if plan.is_main:
        plan.check_launcher()
        rest = {k: v for k, v in (extra or {}).items() if k not in plan.names}
        out = _write_step(root, step, state_json, model, shards, rest, keep_last, generators, tokenizer)
    plan.sync()
    return out


def _write_step(root: Path, step: int, state_json: str, model, optimizer, extra, keep_last: int, generators,
                tokenizer) -> Path:
    """The checkpoint of `step` written into a temp folder, fsynced and renamed in; then the
    pruning. `optimizer`: its state goes to optim.pt, or the folder of the ranks' shards
    (a Path) is moved in."""
    name = f"step-{step:06d}"
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    _clear_killed_saves(root, keep=optimizer if isinstance(optimizer, Path) else None)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        _fill(tmp, state_json, model, optimizer, extra, generators, tokenizer)
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
    _prune(root, step, keep_last)
    return final


def _fill(tmp: Path, state_json: str, model, optimizer, extra, generators, tokenizer) -> None:
    model.save_pretrained(tmp / "model")
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp / "model")
    _test_sleep()
    if isinstance(optimizer, Path):  # the ranks' shard folders (optim/, and one a sharded extra)
        for d in sorted(optimizer.iterdir()):
            os.replace(d, tmp / d.name)
        optimizer.rmdir()
    elif optimizer is not None:
        write_file(tmp / "optim.pt", lambda p: torch.save(optimizer.state_dict(), p))
        _test_sleep()
    for k, obj in (extra or {}).items():
        write_file(tmp / f"{k}.pt", lambda p, obj=obj: torch.save(obj.state_dict(), p))
    write_file(tmp / "rng.pt", lambda p: torch.save(rng_state(generators), p))
    _test_sleep()
    write_file(tmp / "trainer_state.json", lambda p: p.write_text(state_json))


def _prune(root: Path, step: int, keep_last: int) -> None:
    """The newest keep_last - 1 of the steps before `step` stay beside it (keep_last 0: all)."""
    if keep_last > 0:
        older = [p for s, p in _step_dirs(root) if s < step]
        for p in older[: max(len(older) - (keep_last - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)


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
    if hasattr(model, "load_pretrained"):  # a LoRA run's adapters (train/lora.py LoraCheckpoint)
        model.load_pretrained(path / "model")
    else:
        io.load_into(path / "model", model.layout, model.flat)
    if optimizer is not None:  # optim.pt, or the shards of any number of ranks
        load_optimizer(path, optimizer)
    for k, obj in (extra or {}).items():
        if getattr(obj, "sharded", False) or (path / k).is_dir():  # an optimizer's shards (rlcu.parallel.ckpt)
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
    device = device or cfg.resolve_device()
    dtype = dtype or cfg.resolve_dtype()
    if cfg.path is not None:
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
