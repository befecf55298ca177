"""The flat layout cut into buckets, each rank's chunk of every bucket, and the gradient sink
that reduce-scatters a bucket as soon as the backward has finished it (see zero.py).

Buckets split the flat layout at layer boundaries (the embedding, each decoder layer, the final
norm with the LM head); a model without that layout (the critic) is cut into equal chunks.
Bucket k = flat[a, b) is cut into N chunks of s = ceil((b - a) / N) elements, and rank r owns
chunk r of every bucket: flat[a + r s, min(a + (r + 1) s, b)). A rank's shard buffers are those
chunks end to end, S = sum_k s elements (padding zero).

The sink (`model.grad_sink`, a Qwen3's) gives the backward a view of each slot inside its
bucket's own buffer, allocated zeroed on first use; `done(part)` (called by the backward after
the final norm, after each layer and after the embedding) launches the bucket's asynchronous
reduce-scatter while the next layer's backward runs, and at most MAX_INFLIGHT of them stay in
flight before the oldest is waited on, added into the shard gradient and its buffer freed.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from rlcu.memory.parts import MAX_INFLIGHT

CHUNK_NUMEL = 1 << 25  # bucket size for a model without a layer layout (32M elements)


def bucket_bounds(model) -> list[int]:
    """[0 = b_0 < b_1 < ... < b_K = numel]: a Qwen3's layer boundaries, else equal chunks."""
    lay = model.layout
    if hasattr(lay, "layer_bounds"):
        return lay.layer_bounds()
    n = lay.numel
    return list(range(0, n, CHUNK_NUMEL)) + [n]


class Buckets:
    """Bucket ranges and rank `rank`'s chunk of each: see the module docstring."""

    def __init__(self, bounds: list[int], rank: int, size: int):
        self.rank, self.size = rank, size
        self.ranges = list(zip(bounds[:-1], bounds[1:]))
        self.chunk = [-(-(b - a) // size) for a, b in self.ranges]
        self.shard_off = [0]
        for s in self.chunk:
            self.shard_off.append(self.shard_off[-1] + s)
        self.shard_numel = self.shard_off[-1]

    def __len__(self) -> int:
        return len(self.ranges)

    def piece(self, k: int, rank: int | None = None) -> tuple[int, int]:
        """(flat start, valid length) of `rank`'s chunk of bucket k (length 0 past the end)."""
        r = self.rank if rank is None else rank
        a, b = self.ranges[k]
        start = a + r * self.chunk[k]
        return start, max(0, min(self.chunk[k], b - start))

    def pieces(self) -> list[tuple[int, int, int]]:
        """[(flat start, length, offset in the shard)] of this rank's chunks."""
        return [(*self.piece(k), self.shard_off[k]) for k in range(len(self))]


# torch >= 2.12 names them *_single (the *_tensor names are deprecated aliases)
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """out [N s] <- every rank's inp [s], in rank order."""
    return _AG(out, inp, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """out [s] <- the sum over ranks of chunk `rank` of inp [N s]."""
    return _RS(out, inp, op=dist.ReduceOp.SUM, async_op=async_op)


class GradSink:
    """The gradient buckets of an overlapped Qwen3 (`model.grad_sink = sink`): `grads` maps a
    slot name to a view of its bucket's buffer (allocated zeroed on first use); `done(part)`
    reduce-scatters the bucket `part` completes; `shard` accumulates the reduced chunks."""

    def __init__(self, model, buckets: Buckets, dtype: torch.dtype):
        self.model, self.buckets, self.dtype = model, buckets, dtype
        self.device = model.flat.device
        self._slot_bucket = {}
        starts = [a for a, _ in buckets.ranges]
        for name, sl in model.layout.slots.items():
            k = bisect.bisect_right(starts, sl.offset) - 1
            self._slot_bucket[name] = k
        L = model.cfg.num_hidden_layers
        first = {bisect.bisect_right(starts, model.layout.slots[f"layers.{i}.input_norm"].offset) - 1: i
                 for i in range(L)}
        self._part_bucket = {i: k for k, i in first.items()}
        self._part_bucket["final_norm"] = self._slot_bucket["final_norm"]
        self._part_bucket["embed"] = self._slot_bucket["embed"]
        self.grads = _LazyViews(self)
        self._buf: dict[int, torch.Tensor] = {}
        self._pending: list = []
        self.shard: torch.Tensor | None = None
        self.passes = 0  # backward passes reduced since zero_grad

    def buffer(self, k: int) -> torch.Tensor:
        if k not in self._buf:
            self._buf[k] = torch.zeros(self.buckets.chunk[k] * self.buckets.size, device=self.device, dtype=self.dtype)
        return self._buf[k]

    def zero_grad(self) -> None:
        self.flush()
        self._buf.clear()
        if self.shard is None:
            self.shard = torch.zeros(self.buckets.shard_numel, device=self.device, dtype=self.dtype)
        else:
            self.shard.zero_()
        self.passes = 0

    def release(self) -> None:
        self.flush()
        self._buf.clear()
        self.shard = None

    def done(self, part) -> None:
        k = self._part_bucket[part]
        if self.shard is None:  # a backward without zero_grad since the last step: the buckets stay
            self.shard = torch.zeros(self.buckets.shard_numel, device=self.device, dtype=self.dtype)
        buf = self._buf.pop(k, None)
        if buf is None:
            buf = self.buffer(k)  # a bucket this backward never touched (zeros): still reduced, in order
            self._buf.pop(k)
        out = torch.empty(self.buckets.chunk[k], device=self.device, dtype=self.dtype)
        work = reduce_scatter(out, buf, async_op=True)
        self._pending.append((work, buf, out, k))
        while len(self._pending) > MAX_INFLIGHT:
            self._finish(self._pending.pop(0))
        if part == "embed":  # the last bucket of a backward
            self.flush()
            self.passes += 1

    def _finish(self, item) -> None:
        work, _buf, out, k = item
        work.wait()
        o = self.buckets.shard_off[k]
        self.shard[o : o + out.numel()] += out

    def flush(self) -> None:
        while self._pending:
            self._finish(self._pending.pop(0))


class _LazyViews(dict):
    """slot name -> view of its bucket's buffer, the buffer allocated on first use."""

    def __init__(self, sink: GradSink):
        super().__init__()
        self.sink = sink

    def __missing__(self, name):
        s = self.sink
        k = s._slot_bucket[name]
        buf = s.buffer(k)
        sl = s.model.layout.slots[name]
        o = sl.offset - s.buckets.ranges[k][0]
        return buf[o : o + sl.numel].view(sl.shape)  # not cached: the buffer is new each backward

    def __setitem__(self, name, value):  # `g[name] += dw` writes back the same view
        pass
