"""ZeRO-style data parallelism over the flat buffers: the gradient reduce-scattered in buckets,
the optimizer state (fp32 master or none, m, v) as 1/N shards, each rank updating its shard,
the shards all-gathered back into every rank's flat bf16 weights (which its engine reads).

Buckets (buckets.py) split the flat layout at layer boundaries, and rank r owns chunk r of
every bucket; a rank's shard buffers (master, m, v, the reduced gradient) are its chunks end to
end. A collective per bucket moves each chunk to its owner (reduce-scatter) and back
(all-gather), and a shard's AdamW is one launch per bucket over contiguous views (with
`index_base`, the stochastic-rounding bits of a chunk are those of the same elements in one
process).

Two ways the gradient reaches the shards:
  * overlapped (a Qwen3, `model.grad_sink`): the backward writes each bucket's gradient into
    its own buffer, and as soon as a layer's backward is done (`GradSink.done`) its bucket is
    reduce-scattered asynchronously while the next layer's backward runs, added into the shard
    gradient and freed; no full-size gradient buffer exists. Every backward (each micro-batch)
    reduces, so every rank must run the same number of backward passes in a step
    (`equal_passes` / `dummy_backward` in batch.py).
  * at the step (any object with .flat, .grad_flat, .layout): the full gradient buffer is
    reduce-scattered bucket by bucket inside `step`.
Gradient clipping and the non-finite check use the global norm (one all-reduce of the shards'
sums of squares and of the loss's finiteness, so every rank takes the same decision).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlcu.config import OptimConfig
from rlcu.errors import NonFiniteError
from rlcu.ops.adamw import adamw_step, grad_norm
from rlcu.optim import STATE_DTYPES, FlatAdamW, gate
from rlcu.parallel.buckets import Buckets, GradSink, all_gather, bucket_bounds, reduce_scatter
from rlcu.parallel.ckpt import copy_range
from rlcu.parallel.comm import World, world


class ShardedAdamW:
    """FlatAdamW's interface (zero_grad, step(lr, loss) -> info, state_dict / load_state_dict,
    state_bytes, step_count) with the state sharded over the ranks of `world` (module docstring).
    `overlap`: None = when the model offers `grad_sink` (a Qwen3)."""

    sharded = True

    def __init__(self, model, cfg: OptimConfig, w: World | None = None, overlap: bool | None = None):
        self.model, self.cfg = model, cfg
        self.world = w = w or world()
        flat = model.flat
        self.buckets = bk = Buckets(bucket_bounds(model), w.rank, w.size)
        self.master_is_model = flat.dtype == torch.float32 or not cfg.master_weights
        if self.master_is_model and flat.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"optim.master_weights: false needs bfloat16 (or float32) weights, got {flat.dtype}")
        self.grad_dtype = STATE_DTYPES[cfg.grad_dtype] if flat.dtype == torch.bfloat16 else torch.float32
        sd = STATE_DTYPES[cfg.state_dtype]
        S = bk.shard_numel
        self.m = torch.zeros(S, device=flat.device, dtype=sd)
        self.v = torch.zeros(S, device=flat.device, dtype=sd)
        self.master = None
        if not self.master_is_model:
            self.master = torch.zeros(S, device=flat.device, dtype=torch.float32)
            self._copy_master_from_model()
        self.overlap = hasattr(model, "grad_sink") if overlap is None else overlap
        self.sink = None
        if self.overlap:
            model.release_grads()
            self.sink = GradSink(model, bk, self.grad_dtype)
            model.grad_sink = self.sink
        else:
            if getattr(model, "grad_dtype", self.grad_dtype) != self.grad_dtype:
                model.release_grads()
            model.grad_dtype = self.grad_dtype
        self._gshard: torch.Tensor | None = None  # the step-time reduce-scatter's output
        self.step_count = 0
        self.nonfinite_in_row = 0
        self.skipped_total = 0

    def _copy_master_from_model(self) -> None:
        for start, n, o in self.buckets.pieces():
            self.master[o : o + n].copy_(self.model.flat[start : start + n])

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def state_bytes(self) -> dict:
        out = {"m": self.m.numel() * self.m.element_size(), "v": self.v.numel() * self.v.element_size()}
        out["master"] = 0 if self.master is None else self.master.numel() * 4
        return out

    # ---------------------------------------------------------------- the step
    def _reduced_grads(self) -> torch.Tensor:
        if self.sink is not None:
            if self.sink.shard is None or self.sink.passes == 0:
                raise RuntimeError("optimizer step without gradients: call model.backward first")
            self.sink.flush()
            return self.sink.shard
        g = self.model.grad_flat
        if g is None:
            raise RuntimeError("optimizer step without gradients: call model.backward first")
        bk = self.buckets
        out = torch.empty(bk.shard_numel, device=g.device, dtype=g.dtype)
        for k, (a, b) in enumerate(bk.ranges):
            s, o = bk.chunk[k], bk.shard_off[k]
            inp = g[a:b]
            if s * bk.size != b - a:  # pad the bucket to N equal chunks
                inp = torch.cat([inp, inp.new_zeros(s * bk.size - (b - a))])
            reduce_scatter(out[o : o + s], inp)
        self._gshard = out
        return out

    def _all_gather(self) -> None:
        """Every rank's updated chunks into every rank's flat weights, bucket by bucket."""
        bk, flat = self.buckets, self.model.flat
        gloo = self.world.backend == "gloo"
        for k, (a, b) in enumerate(bk.ranges):
            s = bk.chunk[k]
            start, n = bk.piece(k)
            if s * bk.size == b - a:
                inp = flat[start : start + s]
                all_gather(flat[a:b], inp.clone() if gloo else inp)
            else:
                inp = flat.new_zeros(s)
                inp[:n] = flat[start : start + n]
                out = flat.new_empty(s * bk.size)
                all_gather(out, inp)
                flat[a:b] = out[: b - a]

    def step(self, lr: float, loss: float | torch.Tensor | None = None) -> dict:
        """One update from the ranks' summed gradients (each rank's gradient must already be its
        share of the global loss's); `loss` is the global loss (only its finiteness is used).
        Returns {grad_norm, clip_scale, skipped, nonfinite_in_row, lr} (the same on every rank)."""
        g = self._reduced_grads()
        lossf = None if loss is None else float(loss)
        # the shard's squared norm (the tree-reduction kernel: no fp32 copy of the shard) and the
        # loss's non-finiteness, summed over ranks in one all-reduce
        stats = torch.stack([grad_norm(g).square(),
                             torch.tensor(0.0 if lossf is None or math.isfinite(lossf) else 1.0, device=g.device)])
        dist.all_reduce(stats)
        try:
            info, scale = gate(self, stats[0].sqrt(), float(stats[1]) > 0, lossf, lr)
        except NonFiniteError:
            self._gshard = None
            raise
        if scale is None:
            self._gshard = None
            return info
        b1, b2 = self.cfg.betas
        flat = self.model.flat
        for start, n, o in self.buckets.pieces():
            if n == 0:
                continue
            sl = slice(o, o + n)
            p = flat[start : start + n] if self.master is None else self.master[sl]
            adamw_step(p, g[sl], self.m[sl], self.v[sl], None if self.master is None else flat[start : start + n],
                       lr=float(lr), beta1=b1, beta2=b2, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay,
                       step=self.step_count, grad_scale=scale, seed=self.cfg.rounding_seed, index_base=start)
        self._gshard = None
        if self.sink is not None:
            self.sink.release()  # the shard gradient lives through a step's backward passes only
        self._all_gather()
        info.update(clip_scale=float(scale), skipped=0, nonfinite_in_row=0)
        return info

    # ---------------------------------------------------------------- state (see ckpt.py for the files)
    def state_dict(self) -> dict:
        """This rank's shard: CPU copies of m, v (and the fp32 master), with the flat ranges they
        hold, so that a checkpoint of N ranks loads at M (ckpt.load_optimizer)."""
        d = {"format": "rlcu-zero", "rank": self.world.rank, "world_size": self.world.size,
             "numel": self.model.layout.numel, "pieces": self.buckets.pieces(),
             "step_count": self.step_count, "nonfinite_in_row": self.nonfinite_in_row,
             "skipped_total": self.skipped_total, "m": self.m.cpu().clone(), "v": self.v.cpu().clone()}
        if self.master is not None:
            d["master"] = self.master.cpu().clone()
        return d

    def load_sources(self, sources: list[dict]) -> None:
        """Fill this rank's shard from checkpointed state: `sources` are shard dicts (any number
        of ranks) or one full FlatAdamW dict; every rank's weights must already be loaded."""
        numel = self.model.layout.numel
        for src in sources:
            n = src["numel"] if "numel" in src else src["m"].numel()
            if n != numel:
                raise ValueError(f"optimizer state of {n} elements, this model's layout needs {numel} "
                                 f"(a checkpoint of another model?)")
        has_master = all("master" in s for s in sources)
        flat = self.model.flat
        for start, n, o in self.buckets.pieces():
            if n == 0:
                continue
            copy_range(sources, "m", start, self.m[o : o + n])
            copy_range(sources, "v", start, self.v[o : o + n])
            if has_master:
                dst = flat[start : start + n] if self.master is None else self.master[o : o + n]
                copy_range(sources, "master", start, dst)
        if has_master and self.master is not None:
            for start, n, o in self.buckets.pieces():
                flat[start : start + n].copy_(self.master[o : o + n])
        elif self.master is not None:
            self._copy_master_from_model()
        if has_master:
            self._all_gather()  # the weights from the masters (as FlatAdamW does), the same on every rank
        s0 = sources[0]
        self.step_count = int(s0["step_count"])
        self.nonfinite_in_row = int(s0.get("nonfinite_in_row", 0))
        self.skipped_total = int(s0.get("skipped_total", 0))

    def load_state_dict(self, d: dict | list[dict]) -> None:
        self.load_sources(d if isinstance(d, list) else [d])


def make_optimizer(model, cfg: OptimConfig):
    """The trainers' optimizer: FlatAdamW in one process, ShardedAdamW across ranks."""
    w = world()
    if w.distributed:
        return ShardedAdamW(model, cfg, w)
    return FlatAdamW(model, cfg)
