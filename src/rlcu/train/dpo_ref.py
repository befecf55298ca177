"""DPO's reference logprobs: one pass of the frozen reference over every pair, before training,
kept on disk in the run folder and read back on resume.

The reference is the initial policy (the pass runs before the first update and before a
resumed run loads its checkpoint, so the model in memory is still the initial one: no second
copy of the weights is ever made), the base with the adapters off under LoRA (a model over the
same frozen buffer), or a `ref_model` folder loaded for the pass and dropped after it. Across
ranks each rank takes a block of the pairs and the sums are gathered, so every rank holds all.

The file (log.out_dir/ref_logprobs.pt) carries a fingerprint of what the numbers depend on:
every pair's token ids, the reference's source and a sample of its weights, the dtype. A run
that finds a file with its own fingerprint reads it instead of computing (a resume, a rerun of
the same data); another fingerprint is computed afresh and replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from pathlib import Path

import torch

from rlcu.parallel import batch as dp
from rlcu.parallel.comm import all_sum, world
from rlcu.train.pair_batch import Pair, pair_logprobs

FILE = "ref_logprobs.pt"
_SAMPLE = 4096  # weights hashed into the fingerprint, evenly spaced over the flat buffer


def weights_key(model) -> str:
    """A cheap digest of a model's weights: its size, dtype and an even sample of its values."""
    flat = model.flat
    step = max(1, flat.numel() // _SAMPLE)
    sample = flat[::step][:_SAMPLE].detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]
    return f"{flat.numel()}:{str(flat.dtype).removeprefix('torch.')}:{h}"


def fingerprint(sets: dict[str, list[Pair]], source: str, model) -> str:
    """The digest of the pairs of every set (by name), the reference's source and weights."""
    h = hashlib.sha256(json.dumps({"source": source, "weights": weights_key(model)}).encode())
    for name in sorted(sets):
        h.update(name.encode())
        for p, c, r in sets[name]:
            h.update(array("q", (len(p), len(c), len(r), *p, *c, *r)).tobytes())
    return h.hexdigest()


def compute(model, sets: dict[str, list[Pair]], budget: int) -> dict[str, torch.Tensor]:
    """{name: [P, 2] float64 (chosen, rejected) sequence logprobs} under `model`, this rank's
    block of each set computed here and the blocks summed across ranks."""
    out = {}
    for name, pairs in sets.items():
        lo, hi = dp.rank_block(len(pairs))
        t = torch.zeros(len(pairs), 2, dtype=torch.float64)
        if hi > lo:
            t[lo:hi] = pair_logprobs(model, pairs, list(range(lo, hi)), budget)
        out[name] = all_sum(t)
    return out


def load(path: Path, fp: str) -> dict[str, torch.Tensor] | None:
    """The sets stored at `path` when its fingerprint is `fp` on every rank, else None (absent,
    another, unreadable on any rank: then every rank computes them, as the pass is collective)."""
    got = _read(path, fp)
    return got if all_sum(0 if got is None else 1) == world().size else None


def _read(path: Path, fp: str) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a cache: a file that cannot be read (truncated, not torch's) is computed afresh
        return None
    if not isinstance(d, dict) or d.get("fingerprint") != fp:
        return None
    return {k: v for k, v in d["sets"].items()}


def save(path: Path, fp: str, sets: dict[str, torch.Tensor]) -> None:
    """Written by the main rank only, through a temporary file (a killed write leaves no half file)."""
    if not world().is_main:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"fingerprint": fp, "sets": sets}, tmp)
    os.replace(tmp, path)
