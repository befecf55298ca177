"""Qwen3-MoE's sparse MLP after the router GEMM, forward and backward, for the layer: routing
(ops/moe_route.py), token-to-expert sorting (ops/moe_sort.py), the experts' grouped GEMMs with
SwiGLU between and the weighted combine (ops/moe_gemm.py).

    ids, weights, probs = route_fwd(x @ w_router^T, k, norm_topk_prob)     # the layer's GEMM first
    out, saved = experts_fwd(x, ids, weights, w_gate_up, w_down, exact)
    dx, dweights = experts_bwd(dout, x, weights, w_gate_up, w_down, saved, dw_gate_up, dw_down)
    dlogits = route_bwd(dweights, probs, ids, weights, norm_topk_prob, aux_dprobs(C, rows, coef))

Weights as transformers (>= 5) stores them fused: gate_up [E, 2I, H] (gate rows first, then up),
down [E, H, I]; transformers 4's per-expert Linear modules (experts.e.gate_proj / up_proj /
down_proj) stack to the same tensors. The expert outputs are rounded to x's dtype before the
combine, as transformers' are; the routing weights stay fp32 (transformers rounds them to the
logits' dtype first).

LoRA on the experts (`ExpertLora`, PEFT's per-expert adapters over the fused tensors): each GEMM
W_e gets scale B_e A_e beside it, computed on the same layout as two more grouped GEMMs of rank R,
    h = grouped_mm(x, A)   y += scale grouped_mm(h, B)          (the rows' own expert's A_e, B_e)
and differentiated by hand: dB_e += dy^T (scale h), dh = scale dy B_e, dA_e += dh^T x, dx += dh A_e,
through the grouped weight-gradient kernel; the base stays frozen (no base weight gradient).

Everything is on the device with sizes by T alone (no host sync: decode graphs capture it), the
same bits for the same inputs (no atomics), and a token's output independent of the batch by
construction: its route is its own row's, its expert rows' sums walk K in a fixed order, and
the combine adds its k slots in slot order. So exact mode takes these kernels as they are; the
`exact` flag only picks the twin's fixed-tree sums on the CPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlcu.ops.moe_gemm import gemm_config, grouped_dw, grouped_mm, moe_combine, moe_combine_bwd, regime
from rlcu.ops.moe_route import aux_dprobs, aux_loss, aux_stats, route_bwd, route_fwd, route_replay
from rlcu.ops.moe_sort import MoeLayout, moe_sort
from rlcu.ops.swiglu import swiglu_bwd, swiglu_fwd

__all__ = ["ExpertLora", "MoeSaved", "aux_dprobs", "aux_loss", "aux_stats", "experts_bwd", "experts_fwd", "route_bwd",
           "route_fwd", "route_replay"]


class ExpertLora(NamedTuple):
    """Per-expert adapters of a sparse layer (None: that GEMM not adapted): a_gu [E, Rg, H] and
    b_gu [E, 2I, Rg] (gate_up), a_d [E, Rd, I] and b_d [E, H, Rd] (down), in the weights' dtype;
    scale_gu, scale_d: floats; keep: [T] in x's dtype, 1 where a token takes the adapter and 0
    where it does not (the engine's base requests), or None (every token)."""

    a_gu: torch.Tensor | None
    b_gu: torch.Tensor | None
    a_d: torch.Tensor | None
    b_d: torch.Tensor | None
    scale_gu: float
    scale_d: float
    keep: torch.Tensor | None = None


class MoeSaved(NamedTuple):
    """What experts_bwd reads: the layout, gate_up's output gu [rows, 2I], SwiGLU's a [rows, I]
    and down's y [rows, H], all in sorted rows; cfg: the regime the layout was made for; with
    adapters their ExpertLora and shrunk inputs h_gu [rows, Rg], h_d [rows, Rd]."""

    layout: MoeLayout
    gu: torch.Tensor
    a: torch.Tensor
    y: torch.Tensor
    cfg: str
    lora: ExpertLora | None = None
    h_gu: torch.Tensor | None = None
    h_d: torch.Tensor | None = None


def _ranks(lora: ExpertLora | None) -> list[int]:
    return [] if lora is None else [t.shape[1] for t in (lora.a_gu, lora.a_d) if t is not None]


def _adapt(y, x, a, b, scale, layout, gather, cfg, exact, rowmask):
    """y [rows, N] += scale (x A_e^T) B_e^T on the layout's rows -> h [rows, R] (x A_e^T)."""
    h = grouped_mm(x, a, layout, gather, cfg, exact)  # [rows, R]
    if rowmask is not None:
        h = h * rowmask[:, None]
    y.add_(grouped_mm(h, b, layout, False, cfg, exact), alpha=scale)
    return h


def _adapt_bwd(dy, x, a, b, h, scale, layout, gather, cfg, ga, gb):
    """dB_e += dy^T (scale h); dA_e += dh^T x with dh = scale dy B_e -> dh A_e [rows, K] (the
    adapter's share of x's gradient, in sorted rows)."""
    grouped_dw(dy, h * scale, layout, False, gb)
    dh = grouped_mm(dy, b.transpose(1, 2), layout, False, cfg) * scale  # [rows, R]
    grouped_dw(dh, x, layout, gather, ga)
    return grouped_mm(dh, a.transpose(1, 2), layout, False, cfg)


def _check(x, ids, weights, w_gate_up, w_down):
    T, H = x.shape if x.dim() == 2 else (-1, -1)
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int32:
        raise ValueError(f"experts_fwd: x must be [T, H] and ids int32 [T, k], got {list(x.shape)} and "
                         f"{ids.dtype} {list(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError(f"experts_fwd: weights must be fp32 {list(ids.shape)}, got {weights.dtype} "
                         f"{list(weights.shape)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"experts_fwd: w_gate_up must be [E, 2I, {H}], got {list(w_gate_up.shape)}")
    E, I2 = w_gate_up.shape[:2]
    if w_down.shape != (E, H, I2 // 2):
        raise ValueError(f"experts_fwd: w_down must be [{E}, {H}, {I2 // 2}], got {list(w_down.shape)}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(f"experts_fwd: x and the weights must share a dtype, got {x.dtype}, {w_gate_up.dtype}, "
                        f"{w_down.dtype}")


def experts_fwd(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, exact: bool = False,
                lora: ExpertLora | None = None) -> tuple[torch.Tensor, MoeSaved]:
    """x [T, H], ids [T, k] int32 and weights [T, k] fp32 (route_fwd's), w_gate_up [E, 2I, H],
    w_down [E, H, I] -> (out [T, H] in x's dtype, MoeSaved):
    out[t] = sum_{s} weights[t, s] down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, s]; with
    `lora`, each W_e is W_e + scale B_e A_e (computed unmerged, module docstring). In exact mode
    the adapters' ranks join the regime's K (a rank's K tail then keeps one tiling for every T, so
    the engine's decode steps and the trainer's forward agree); the default mode keeps the base's
    regime (prefill's tiles for training)."""
    _check(x, ids, weights, w_gate_up, w_down)
    T, k = ids.shape
    E, H = w_gate_up.shape[0], x.shape[1]
    cfg = regime(T, k, E, math.gcd(H, w_down.shape[2], *(_ranks(lora) if exact else ())))
    layout = moe_sort(ids, E, gemm_config(cfg)[0])
    rowmask = None
    if lora is not None and lora.keep is not None:  # a sorted row's token's keep, 0 in padding
        rowmask = lora.keep[(layout.pairs.clamp(min=0) // k).long()] * (layout.pairs >= 0).to(x.dtype)
    gu = grouped_mm(x, w_gate_up, layout, True, cfg, exact)  # [rows, 2I]
    h_gu = h_d = None
    if lora is not None and lora.a_gu is not None:
        h_gu = _adapt(gu, x, lora.a_gu, lora.b_gu, lora.scale_gu, layout, True, cfg, exact, rowmask)
    a = swiglu_fwd(gu, exact)  # [rows, I]
    y = grouped_mm(a, w_down, layout, False, cfg, exact)  # [rows, H]
    if lora is not None and lora.a_d is not None:
        h_d = _adapt(y, a, lora.a_d, lora.b_d, lora.scale_d, layout, False, cfg, exact, rowmask)
    return moe_combine(y, layout.pos, weights, T), MoeSaved(layout, gu, a, y, cfg, lora, h_gu, h_d)


def experts_bwd(dout: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, saved: MoeSaved, dw_gate_up: torch.Tensor | None,
                dw_down: torch.Tensor | None,
                lora_grads: ExpertLora | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dout [T, H] -> (dx [T, H] in x's dtype, dweights [T, k] fp32: route_bwd's input);
    dw_gate_up [E, 2I, H] and dw_down [E, H, I] accumulated in place (+=, in their dtype); both
    None: no weight gradient (a frozen base). lora_grads: the adapters' gradients (an ExpertLora
    of [E, ...] buffers, += in place) where the forward had `lora`; the input gradient takes
    their share either way.
    The forward in reverse: combine, down, SwiGLU, gate_up, each token's k rows summed back in
    slot order."""
    layout, T = saved.layout, x.shape[0]
    if dout.shape != x.shape:
        raise ValueError(f"experts_bwd: dout must be {list(x.shape)}, got {list(dout.shape)}")
    for name, g, w in (("dw_gate_up", dw_gate_up, w_gate_up), ("dw_down", dw_down, w_down)):
        if g is not None and g.shape != w.shape:
            raise ValueError(f"experts_bwd: {name} must be {list(w.shape)}, got {list(g.shape)}")
    dy, dweights = moe_combine_bwd(dout, saved.y, layout.pos, weights)  # [rows, H], [T, k]
    if dw_down is not None:
        grouped_dw(dy, saved.a, layout, False, dw_down)
    dx_cfg = f"{saved.cfg}_dx"  # the dA GEMMs' own tiles, at the layout's BM (the adapters' backward's too)
    da = grouped_mm(dy, w_down.transpose(1, 2), layout, False, dx_cfg)  # [rows, I]
    lo, lg = saved.lora, lora_grads
    if lo is not None and lg is None:
        raise ValueError("experts_bwd: the forward had adapters: lora_grads must hold their gradients")
    if lo is not None and lo.a_d is not None:
        da += _adapt_bwd(dy, saved.a, lo.a_d, lo.b_d, saved.h_d, lo.scale_d, layout, False, dx_cfg, lg.a_d, lg.b_d)
    dgu = swiglu_bwd(da, saved.gu)  # [rows, 2I]
    if dw_gate_up is not None:
        grouped_dw(dgu, x, layout, True, dw_gate_up)
    dxr = grouped_mm(dgu, w_gate_up.transpose(1, 2), layout, False, dx_cfg)  # [rows, H]
    if lo is not None and lo.a_gu is not None:
        dxr += _adapt_bwd(dgu, x, lo.a_gu, lo.b_gu, saved.h_gu, lo.scale_gu, layout, True, dx_cfg, lg.a_gu,
                          lg.b_gu)
    return moe_combine(dxr, layout.pos, None, T), dweights
