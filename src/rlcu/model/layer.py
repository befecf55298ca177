"""One decoder layer, written once for the trainer and the engine, and its backward.

`layer_fwd` states the layer's math in order:
    h1 = rmsnorm(x)                              input norm
    qkv = h1 Wqkv^T (+ b)                        QKV projection, [N, (Hq + 2 Hk) D] (b: Qwen2's q/k/v bias)
    q, k = rope(rmsnorm(q)), rope(rmsnorm(k))    q/k norm + rope, K/V placed where attention reads them
                                                 (rope alone where the family has no q/k norm)
    o = attention(q, K, V)
    x2 = x + o Wo^T                              O projection + residual
    h2 = rmsnorm(x2)                             post norm
    y = x2 + swiglu(h2 Wgu^T) Wd^T               gate_up, SwiGLU, down + residual
                                                 (a sparse MoE layer: router and experts, model/moe.py)
What differs between runners is passed in, never written again:
- `kv`, where K/V are written and read and which attention kernel reads them: `Packed` here (the
  trainer's packed q/k/v of the step's own tokens, varlen attention, the default or exact mode's)
  or the engine's paged cache (engine/paged_forward.py `PagedKV`: k/v written to their kv slots,
  paged attention, exact mode's over the cache). model/ imports nothing of the engine, so the
  engine passes its own. Protocol: `place(i, qkv, q_w, k_w, pos, bias) -> (q, k, v, rq, rk)` (k, v,
  rq, rk may be None where the cache holds them, nothing is kept or there is no norm; q_w = k_w =
  None: no q/k norm; bias None: none) and `attend(i, q, k, v) -> (o, lse)`.
- `ops`, which kernel runs each step: `Kernels` here (one op a step; the GEMM cuBLAS's or, in exact
  mode, the batch-invariant one; the residual a new tensor, or updated in place where nothing is
  kept), or the engine's fused small-step schedule (engine/paged_forward.py `Fused`), which defers a
  norm and its GEMM until the next step consumes them and then launches one kernel for the three.
  Protocol: `norm(x, w, eps) -> (h, rstd)`, `linear(a, w, residual=None) -> a w^T (+ residual)`,
  `swiglu(gu) -> a`.
- `keep`, what the forward keeps for the backward (the trainer's checkpointing mode; the engine
  keeps nothing).
- `lora`, the adapters (None: none): after each adapted linear (module 'qkv', 'o', 'gate_up' or
  'down') `apply(i, module, x, y)` adds the adapter's product on the linear's input x to its output
  y in place (before the q/k norm reads qkv; after the residual joins o's and down's output, which
  is the same sum). The trainer's is model/lora_run.py `LoraRun`; the engine passes its own (the
  grouped kernels of a batch of adapters). With adapters the base is frozen: `layer_bwd` takes no
  weight gradient of it and adds the adapter's share (`lora.backward`) to each input gradient.
So exact mode's engine and trainer run this one function with the batch-invariant kernels, and
their agreement holds by construction: the only pieces that differ are the attention over packed
K/V vs over the cache, whose kernels share their reduction order (ops/attention_exact.py), and
where K/V land (the trainer's qk_norm_rope writes them as a cache of N one-token blocks, through
the engine's qkv_prep kernel with stats, so each row's float ops are the engine's).

`layer_bwd` mirrors the forward (llm.c style): the same steps in reverse over the named
activations `layer_fwd(keep="all")` returns; the backward runs the default mode's kernels.
"""

from __future__ import annotations

import torch

from rlcu.model import moe
from rlcu.ops._matmul import acc_wgrad
from rlcu.ops.attention import attention_bwd, attention_fwd
from rlcu.ops.attention_exact import attention_exact_varlen
from rlcu.ops.matmul_invariant import mm as mm_invariant
from rlcu.ops.qkv_prep import qk_norm_rope
from rlcu.ops.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from rlcu.ops.rope import rope_bwd
from rlcu.ops.swiglu import swiglu_bwd, swiglu_fwd

KEEP = ("none", "inputs", "attention", "all")


class Kernels:
    """One kernel a step. exact: the model's mode, for the norms and SwiGLU (on the GPU their
    kernels are the same in both modes; on the CPU the twins' fixed-tree sums); gemm_exact: the
    batch-invariant GEMM (None: as exact; the trainer's recompute of a checkpointed layer passes
    False); in_place: the residual adds update the residual stream in place (the engine, which
    keeps nothing: no copy of x for cuBLAS's C)."""

    def __init__(self, exact: bool, gemm_exact: bool | None = None, in_place: bool = False):
        self.exact, self.in_place = exact, in_place
        self.gemm_exact = exact if gemm_exact is None else gemm_exact

    def norm(self, x, w, eps: float):
        return rmsnorm_fwd(x, w, eps, exact=self.exact)

    def linear(self, a, w, residual=None):
        if self.gemm_exact:
            return mm_invariant(a, w, residual, out=residual if self.in_place else None)
        if residual is None:
            return a @ w.t()
        return residual.addmm_(a, w.t()) if self.in_place else torch.addmm(residual, a, w.t())

    def swiglu(self, gu):
        return swiglu_fwd(gu, exact=self.exact)


class Packed:
    """The trainer's K/V: q, k, v of the packed tokens themselves (cu_seqlens, max_seqlen), the
    varlen attention (exact: the batch-invariant one). saved: a layer's (o, lse) kept by a
    selective-checkpointing forward, which the recompute reads instead of running attention."""

    def __init__(self, model, cu_seqlens, max_seqlen: int, exact: bool, saved=None):
        self.cfg, self.model_exact = model.cfg, model.exact
        self.inv_freq, self.mscale = model.inv_freq, model.rope_mscale
        self.cu, self.max_seqlen, self.exact, self.saved = cu_seqlens, max_seqlen, exact, saved

    def place(self, i: int, qkv, q_w, k_w, pos, bias=None):
        c = self.cfg
        return qk_norm_rope(qkv, q_w, k_w, pos, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                            c.rms_norm_eps, self.inv_freq, exact=self.model_exact, mscale=self.mscale, bias=bias)

    def attend(self, i: int, q, k, v):
        if self.saved is not None:
            return self.saved
        attend = attention_exact_varlen if self.exact else attention_fwd
        return attend(q, k, v, self.cu, self.max_seqlen, self.cfg.head_dim**-0.5)


def layer_fwd(model, i: int, x: torch.Tensor, pos: torch.Tensor, kv, ops, keep: str = "none", lora=None,
              router_logits=None, routes=None):
    """Layer i of `model` (its cfg and weight views w) on the residual stream x [N, hidden] at
    positions pos [N] -> (y [N, hidden], kept): kept is None ('none'), {x} ('inputs': checkpointed),
    {x, attn: (o, lse)} ('attention') or every activation `layer_bwd` reads ('all'); a sparse MoE
    layer's also holds model/moe.py's (router_logits and aux at least). router_logits: a sparse
    layer's kept logits, which route its recompute as its forward was routed; routes: who picks a
    sparse layer's experts (model/moe.py mlp_fwd: the trainer's record and replay, the engine's log)."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    N, eps = x.shape[0], c.rms_norm_eps
    h1, r1 = ops.norm(x, w[p + "input_norm"], eps)
    qkv = ops.linear(h1, w[p + "qkv"])  # [N, (Hq + 2 Hk) D]
    if lora is not None:
        lora.apply(i, "qkv", h1, qkv)
    q, k, v, rq, rk = kv.place(i, qkv, w.get(p + "q_norm"), w.get(p + "k_norm"), pos, w.get(p + "qkv_bias"))
    o, lse = kv.attend(i, q, k, v)
    x2 = ops.linear(o.view(N, c.q_size), w[p + "o"], x)
    if lora is not None:
        lora.apply(i, "o", o.view(N, c.q_size), x2)
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {', '.join(KEEP)}; got {keep!r}")
    h2, r2 = ops.norm(x2, w[p + "post_norm"], eps)
    gu = a = mk = None
    if c.sparse_layer(i):
        y, mk = moe.mlp_fwd(model, i, h2, x2, ops, keep, router_logits, routes, lora)
    else:
        gu = ops.linear(h2, w[p + "gate_up"])  # [N, 2I]
        if lora is not None:
            lora.apply(i, "gate_up", h2, gu)
        a = ops.swiglu(gu)
        y = ops.linear(a, w[p + "down"], x2)
        if lora is not None:
            lora.apply(i, "down", a, y)
    if keep == "none":
        return y, None
    if keep == "inputs":
        return y, {"x": x, **(mk or {})}
    if keep == "attention":
        return y, {"x": x, "attn": (o, lse), **(mk or {})}
    Hq, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q0 = k0 = None  # the q/k norms' inputs, views (copied in the backward); without norms qkv is not kept
    if c.fam.qk_norm:
        q0 = qkv[:, : c.q_size].view(N, Hq, D)
        k0 = qkv[:, c.q_size : c.q_size + c.kv_size].view(N, Hk, D)
    return y, dict(x=x, h1=h1, r1=r1, q0=q0, k0=k0, v=v, rq=rq, rk=rk, q=q, k=k, o=o, lse=lse,
                   x2=x2, h2=h2, r2=r2, gu=gu, a=a, **(mk or {}))


def _wgrad(g: dict | None, name: str, dy: torch.Tensor, x: torch.Tensor) -> None:
    if g is not None:  # None: a frozen base (adapters train)
        acc_wgrad(g[name], dy, x)


def _lora_dx(lora, i: int, module: str, x, dy, dx):
    return dx if lora is None else lora.backward(i, module, x, dy, dx)


def layer_bwd(model, i: int, dy: torch.Tensor, s: dict, pos, cu, max_seqlen: int, lora=None) -> torch.Tensor:
    """dy [N, hidden] -> dx, the layer's weight gradients accumulated into model._g (none where the
    base is frozen: `model.trains_base` false), the adapters' into theirs (`lora`, as in
    layer_fwd); s: the activations of `layer_fwd(keep="all")` over packed tokens (cu, max_seqlen)."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    g = model._g if model.trains_base else None
    N, Hq, Hk, D = dy.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    if c.sparse_layer(i):  # y = x2 + moe(h2); daux: the load-balancing loss's, set by the trunk
        dh2 = moe.mlp_bwd(model, i, dy, s, g, s.get("daux"), lora)
    else:  # y = x2 + swiglu(h2 Wgu^T) Wd^T
        _wgrad(g, p + "down", dy, s["a"])
        da = _lora_dx(lora, i, "down", s["a"], dy, dy @ w[p + "down"])
        dgu = swiglu_bwd(da, s["gu"])
        _wgrad(g, p + "gate_up", dgu, s["h2"])
        dh2 = _lora_dx(lora, i, "gate_up", s["h2"], dgu, dgu @ w[p + "gate_up"])
    dx2, dw = rmsnorm_bwd(dh2, s["x2"], w[p + "post_norm"], s["r2"], dy)  # + dy: the residual
    if g is not None:
        g[p + "post_norm"] += dw
    # attention: x2 = x + attn(rope(norm(q)), rope(norm(k)), v) Wo^T
    o = s["o"].view(N, c.q_size)
    _wgrad(g, p + "o", dx2, o)
    do = _lora_dx(lora, i, "o", o, dx2, dx2 @ w[p + "o"]).view(N, Hq, D)
    dq, dk, dv = attention_bwd(do, s["q"], s["k"], s["v"], s["o"], s["lse"], cu, max_seqlen, D**-0.5)
    dq0 = rope_bwd(dq, pos, model.inv_freq, model.rope_mscale).reshape(N * Hq, D)
    dk0 = rope_bwd(dk, pos, model.inv_freq, model.rope_mscale).reshape(N * Hk, D)
    if c.fam.qk_norm:
        dq0, dwq = rmsnorm_bwd(dq0, s["q0"].reshape(N * Hq, D), w[p + "q_norm"], s["rq"])
        dk0, dwk = rmsnorm_bwd(dk0, s["k0"].reshape(N * Hk, D), w[p + "k_norm"], s["rk"])
        if g is not None:
            g[p + "q_norm"] += dwq
            g[p + "k_norm"] += dwk
    dqkv = torch.cat([dq0.view(N, c.q_size), dk0.view(N, c.kv_size), dv.reshape(N, c.kv_size)], 1)
    if c.fam.qkv_bias and g is not None:  # qkv = h1 Wqkv^T + b: db = the sum over tokens
        g[p + "qkv_bias"] += dqkv.sum(0, dtype=torch.float32).to(g[p + "qkv_bias"].dtype)
    _wgrad(g, p + "qkv", dqkv, s["h1"])
    dh1 = _lora_dx(lora, i, "qkv", s["h1"], dqkv, dqkv @ w[p + "qkv"])
    dx, dw = rmsnorm_bwd(dh1, s["x"], w[p + "input_norm"], s["r1"], dx2)  # + dx2: the residual
    if g is not None:
        g[p + "input_norm"] += dw
    return dx
