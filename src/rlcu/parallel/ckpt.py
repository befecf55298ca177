"""Checkpoints of a sharded optimizer: one folder, written atomically by all ranks, loadable at
any number of ranks.

A checkpoint of N ranks holds `optim/rank-RRRRR-of-NNNNN.pt` (each rank's ShardedAdamW
state_dict: its m, v, master chunks and the flat ranges they cover) where one process writes
`optim.pt`. Saving: rank 0 clears `root/.shards-step-S/`; a barrier; every rank writes its file
there (temp name, fsync, rename); a barrier; rank 0 writes the rest of the checkpoint through
train/checkpoint.save_checkpoint, which moves the shard folder into its temp folder before the
one atomic rename; a barrier. A rank that dies midway leaves no step-S folder (its watchdog ends
the others), and the next save clears what was left.

Loading (`load_optimizer`, any N -> any M): each rank copies, for every flat range it owns, the
overlapping parts of the saved ranges (`copy_range`), reading the files memory-mapped so that
no rank holds more than its share; one process assembles the full state the same way.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from rlcu.parallel import comm as W

_SHARD_RE = re.compile(r"^rank-(\d+)-of-(\d+)\.pt$")


def copy_range(sources: list[dict], key: str, start: int, dst: torch.Tensor) -> None:
    """dst <- flat[start : start + len(dst)] of the state `key`, gathered from `sources` (shard
    dicts with 'pieces', or full dicts). Raises when the sources do not cover the range."""
    n = dst.numel()
    covered = 0
    for src in sources:
        pieces = src.get("pieces") or [(0, src[key].numel(), 0)]
        t = src[key]
        for ps, pn, po in pieces:
            lo, hi = max(start, ps), min(start + n, ps + pn)
            if lo < hi:
                dst[lo - start : hi - start].copy_(t[po + lo - ps : po + hi - ps])
                covered += hi - lo
    if covered != n:
        raise ValueError(f"the checkpoint's optimizer shards cover {covered} of the {n} elements of "
                         f"{key}[{start}:{start + n}] (a rank's file is missing?)")


def read_sources(path, name: str = "optim") -> list[dict]:
    """The optimizer state dicts of a checkpoint folder: its shard files (name/), or name.pt."""
    path = Path(path)
    d = path / name
    if d.is_dir():
        files = sorted((f for f in d.iterdir() if _SHARD_RE.match(f.name)), key=lambda f: f.name)
        if not files:
            raise FileNotFoundError(f"{d}: no rank-*-of-*.pt optimizer shards")
        n = int(_SHARD_RE.match(files[0].name).group(2))
        have = sorted(int(_SHARD_RE.match(f.name).group(1)) for f in files)
        if have != list(range(n)):
            missing = sorted(set(range(n)) - set(have))
            raise FileNotFoundError(f"{d}: a checkpoint of {n} ranks without the shards of ranks {missing}")
        return [torch.load(f, map_location="cpu", weights_only=True, mmap=True) for f in files]
    f = path / f"{name}.pt"
    if not f.exists():
        raise FileNotFoundError(f"{path}: no {name}.pt (nor {name}/ shards) to restore the optimizer from")
    return [torch.load(f, map_location="cpu", weights_only=True)]


def load_optimizer(path, optimizer, name: str = "optim") -> None:
    """Restore `optimizer` (FlatAdamW or ShardedAdamW) from a checkpoint of any number of ranks
    (`name`: optim, or the name of an extra optimizer such as the critic's)."""
    sources = read_sources(path, name)
    if getattr(optimizer, "sharded", False):
        optimizer.load_sources(sources)
        return
    if len(sources) == 1 and "pieces" not in sources[0]:
        optimizer.load_state_dict(sources[0])
        return
    numel = int(sources[0]["numel"])
    full = {k: sources[0][k] for k in ("step_count", "nonfinite_in_row", "skipped_total")}
    keys = ["m", "v"] + (["master"] if all("master" in s for s in sources) else [])
    for k in keys:
        full[k] = torch.empty(numel, dtype=sources[0][k].dtype)
        _copy_full(sources, k, full[k])
    optimizer.load_state_dict(full)


def _copy_full(sources, key, dst) -> None:
    # the layout's alignment padding is covered by the chunks too; past the last range is padding
    dst.zero_()
    copy_range(sources, key, 0, dst)


class _ShardFolder:
    """What rank 0 hands to save_checkpoint as its optimizer: the folders of every rank's
    shards (optim/, and one a sharded extra), moved into the checkpoint's temp folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    def write_into(self, tmp: Path) -> None:
        for d in sorted(self.folder.iterdir()):
            os.replace(d, tmp / d.name)
        self.folder.rmdir()


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as fh:
        os.fsync(fh.fileno())


def save_sharded(root, step: int, model, optimizer, state: dict, keep_last: int, **kw) -> Path:
    """save_checkpoint for a ShardedAdamW: called on every rank (see the module docstring)."""
    from rlcu.train.checkpoint import no_space, not_written, save_checkpoint, write_file

    w = optimizer.world
    root = Path(root)
    name = f"step-{int(step):06d}"
    shards = root / f".shards-{name}"
    if w.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for p in root.glob(".shards-*"):  # left by a killed save
            shutil.rmtree(p, ignore_errors=True)
        shards.mkdir()
    extra = dict(kw.pop("extra", None) or {})
    sharded = {"optim": optimizer, **{k: extra.pop(k) for k in list(extra) if getattr(extra[k], "sharded", False)}}
    if w.is_main:
        for k in sharded:
            (shards / k).mkdir()
    W.barrier()
    for k, obj in sharded.items():
        f = shards / k / f"rank-{w.rank:05d}-of-{w.size:05d}.pt"
        tmpf = f.parent / f".{f.name}.tmp"

        def write(p, obj=obj):  # a full disk says so with the file (torch.save's error hides it)
            torch.save(obj.state_dict(), p)
            _fsync_file(p)

        try:
            write_file(tmpf, write)
        except BaseException as e:
            tmpf.unlink(missing_ok=True)  # the shards folder itself: the next save clears it, at any ranks
            if not no_space(e):
                raise
            raise not_written(e, root, name) from e
        os.replace(tmpf, f)
    W.barrier()
    out = root / name
    if w.is_main:
        W.check_launcher()  # a launcher killed meanwhile: no checkpoint after it (the restart's folder)
        out = save_checkpoint(root, step, model, _ShardFolder(shards), state, keep_last, extra=extra, **kw)
    W.barrier()
    return out
