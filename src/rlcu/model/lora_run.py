"""One adapter set applied in the layer (model/layer.py's `lora`) and differentiated by hand.

After each adapted linear the layer calls `apply(i, module, x, y)`: y += scale * (drop(x) A^T) B^T,
in place, slice by slice of the fused module (model/lora.py's layout). The engine passes its own
object of the same protocol (the grouped multi-adapter kernels of ops/lora.py over a batch's
per-sequence adapter index); this one is the trainer's, for one adapter set:
- default mode: cuBLAS GEMMs;
- exact mode: ops/lora.py's grouped kernels (`lora_apply`: shrink then expand) with every row on
  adapter 0, the launches the engine makes, so that the trainer's forward and the engine's agree
  bit for bit (their batch invariance is the kernels').

`backward(i, module, x, dy, dx)` is the adapter's share of the layer's backward, with h = drop(x) A^T
recomputed (r columns a slice: cheaper than keeping it):
    dB_j += dy_j^T (scale h_j)          dh_j = scale dy_j B_j
    dA_j += dh_j^T drop_j(x)            dx += (dh_j A_j) * mask_j / (1 - p)
(dy_j: the slice's output columns of dy). Dropout, in a training forward only, draws each slice's
mask from (the forward's seed, layer, module, slice), as PEFT's separate q/k/v modules have
masks of their own, so the recompute of a checkpointed layer and the backward see the same masks.
The seed is an int64 tensor on the device that the masks' kernel reads (ops/dropout.py), never a
host number, so a captured training step (train/step_graph.py) replays with the seed written
there before each replay: fresh masks every step, the eager step's bits.
"""

from __future__ import annotations

import torch

from rlcu.model.lora import MODULES, ExpertSpec, LoraAdapters, ModuleSpec
from rlcu.ops._matmul import acc_wgrad
from rlcu.ops.dropout import dropout_mask
from rlcu.ops.lora import lora_apply
from rlcu.ops.moe import ExpertLora


def expert_lora(ex: ExpertSpec | None, views: dict, keep: torch.Tensor | None = None) -> ExpertLora | None:
    """An ExpertSpec's tensors among `views` (weights or gradients) as ops/moe.py's ExpertLora."""
    if ex is None:
        return None
    gu = (views[ex.gate_up[0].name], views[ex.gate_up[1].name]) if ex.gate_up else (None, None)
    d = (views[ex.down[0].name], views[ex.down[1].name]) if ex.down else (None, None)
    return ExpertLora(*gu, *d, ex.scale_gu, ex.scale_d, keep)


class LoraRun:
    """The trainer's adapter application for one forward (and its backward). exact: the grouped
    kernels (the engine's launches); seed: the forward's dropout seed, an int64 [1] tensor on the
    device, None for no dropout (the engine, logits, a forward without gradients)."""

    def __init__(self, adapters: LoraAdapters, exact: bool = False, seed: torch.Tensor | None = None):
        self.ad, self.exact, self.seed = adapters, exact, seed
        self.p = adapters.cfg.dropout if seed is not None else 0.0
        self.scale, self.r = adapters.cfg.scale, adapters.cfg.r

    def _mask(self, x: torch.Tensor, i: int, module: str, j: int) -> torch.Tensor:
        """Slice j's dropout multiplier (mask / (1 - p), in x's dtype), from the forward's seed and
        the slice's own stream."""
        return dropout_mask(self.seed, i * 131 + MODULES.index(module) * 7 + j, self.p, x.shape[0], x.shape[1],
                            x.dtype)

    def _shrink(self, sp: ModuleSpec, i: int, x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """h = drop(x) A^T [N, S r] (each slice's own mask)."""
        if not self.p:
            return x @ A.t()
        r = self.r
        return torch.cat([(x * self._mask(x, i, sp.module, j)) @ A[j * r : (j + 1) * r].t()
                          for j in range(len(sp.slices))], 1)

    def apply(self, i: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [N, out] += the adapter's product for layer i's `module` on its input x [N, K]."""
        sp = self.ad.layout.spec(i, module)
        if sp is None:
            return
        A, B = self.ad.w[sp.A.name], self.ad.w[sp.B.name]
        if self.exact and not self.p:  # dropout has no engine twin: it makes no exact forward
            idx = torch.zeros(x.shape[0], device=x.device, dtype=torch.int32)
            scale = torch.full((1,), self.scale, device=x.device, dtype=torch.float32)
            lora_apply(x, A[None], B[None], idx, y, scale, sp.slices)
            return
        h, r = self._shrink(sp, i, x, A), self.r
        for j, (c0, c1) in enumerate(sp.slices):
            y[:, c0:c1].addmm_(h[:, j * r : (j + 1) * r], B[c0:c1].t(), alpha=self.scale)

    def experts(self, i: int) -> ExpertLora | None:
        """Sparse layer i's expert adapters for ops/moe.py experts_fwd (every token adapted),
        or None where the layer has none."""
        return expert_lora(self.ad.layout.experts.get(i), self.ad.w)

    def expert_grads(self, i: int) -> ExpertLora | None:
        """Their gradient buffers (experts_bwd's lora_grads)."""
        self.ad.ensure_grads()
        return expert_lora(self.ad.layout.experts.get(i), self.ad.g)

    def backward(self, i: int, module: str, x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """dA and dB of layer i's `module` += from its input x [N, K] and output gradient dy
        [N, out]; dx [N, K], the input gradient through the base, gets the adapter's share in place."""
        sp = self.ad.layout.spec(i, module)
        if sp is None:
            return dx
        self.ad.ensure_grads()
        A, B = self.ad.w[sp.A.name], self.ad.w[sp.B.name]
        gA, gB = self.ad.g[sp.A.name], self.ad.g[sp.B.name]
        r, s = self.r, self.scale
        h = self._shrink(sp, i, x, A)  # [N, S r], the forward's
        dh = []
        for j, (c0, c1) in enumerate(sp.slices):
            dyj = dy[:, c0:c1]
            acc_wgrad(gB[c0:c1], dyj, h[:, j * r : (j + 1) * r] * s)
            dh.append((dyj @ B[c0:c1]) * s)  # [N, r]
        if not self.p:
            dH = torch.cat(dh, 1) if len(dh) > 1 else dh[0]
            acc_wgrad(gA, dH, x)
            return dx.addmm_(dH, A)
        for j, dhj in enumerate(dh):
            m, Aj = self._mask(x, i, module, j), A[j * r : (j + 1) * r]
            acc_wgrad(gA[j * r : (j + 1) * r], dhj, x * m)
            dx.add_((dhj @ Aj) * m)
        return dx
