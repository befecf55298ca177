"""Checkpoints of a sharded optimizer: one folder, written atomically by all ranks, loadable at
any number of ranks.

A checkpoint of N ranks holds `optim/rank-RRRRR-of-NNNNN.pt` (each rank's ShardedAdamW
state_dict: its m, v, master chunks and the flat ranges they cover) where one process writes
`optim.pt`. Saving is rlcu.train.checkpoint's writer following this module's strategy
(`sharded_save`): rank 0 clears `root/.shards-step-S/`; a barrier; every rank writes its files
there; a barrier; rank 0 writes the rest of the checkpoint and moves the shard folder into its
temp folder before the one atomic rename; a barrier. A rank that dies midway leaves no step-S
folder (its watchdog ends the others), and the next save clears what was left.

Loading (`load_optimizer`, any N -> any M): each rank copies, for every flat range it owns, the
overlapping parts of the saved ranges (`copy_range`), reading the files memory-mapped so that
no rank holds more than its share; one process assembles the full state the same way.
"""

from __future__ import annotations

import re
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


class ShardedSave:
    """The sharded strategy of a checkpoint save, which rlcu.train.checkpoint's writer follows:
    the optimizers whose state is sharded over the ranks (`names`: optim, and a sharded extra
    such as the critic's), the file each rank writes of each, and where the ranks wait for one
    another. The writer owns the files (temp names, fsync, a full disk, the one rename)."""

    def __init__(self, sharded: dict, w: W.World):
        self.sharded, self.world = sharded, w
        self.names = list(sharded)

    @property
    def is_main(self) -> bool:
        """Rank 0 prepares the shard folder and writes the rest of the checkpoint."""
        return self.world.is_main

    def files(self) -> list[tuple[str, str, object]]:
        """(name, file name, object with state_dict()) of each shard this rank writes."""
        w = self.world
        return [(k, f"rank-{w.rank:05d}-of-{w.size:05d}.pt", obj) for k, obj in self.sharded.items()]

    def sync(self) -> None:
        W.barrier()

    def check_launcher(self) -> None:
        """Before rank 0 renames the checkpoint in: a launcher killed meanwhile leaves no
        checkpoint after it (its restart owns the folder)."""
        W.check_launcher()


def sharded_save(optimizer, extra: dict | None) -> ShardedSave | None:
    """The strategy of a save whose optimizer is a ShardedAdamW (its extras' sharded optimizers
    go along); None when one process holds the whole state."""
    if not getattr(optimizer, "sharded", False):
        return None
    more = {k: o for k, o in (extra or {}).items() if getattr(o, "sharded", False)}
    return ShardedSave({"optim": optimizer, **more}, optimizer.world)
