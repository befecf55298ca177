"""The model's forward over the paged KV cache, and the LM head and sampler on its last rows:
what one engine step computes, whatever its mix of prefill chunks and decodes.

The forward reads the model's weight views (`model.w`) at every step, never a copy: an
optimizer step that updates `model.flat` in place is seen by the next step (CUDA graphs
captured on those views see it too, since the addresses do not change; if `model.flat` is
replaced by another tensor the graphs are captured again, engine/graphs.py).

Each layer is the trainer's own definition (model/layer.py `layer_fwd`), over the N new tokens of
the step, with the engine's own parts passed in:
- `PagedKV`: qkv_prep norms and rotates q and k and writes k and v to their kv slots of the pool;
  attention reads the cache (paged_attention; in exact mode attention_exact_paged, whose
  reduction order is the trainer's varlen one, and qkv_prep with its stats, the variant the
  trainer's qk_norm_rope runs); a family without q/k norm passes q_w = k_w = None (rope alone), one
  with q/k/v biases (Qwen2) passes them in, both to the same kernels (model/family.py).
- the schedule (`schedule`): in exact mode (the model's `exact`, read at every step; ops/exact.py)
  the trainer's kernels with the batch-invariant GEMM, so the engine's sampled-token logprob
  (taken by the trainer's head kernel, `sample_rows`) is the trainer's bit for bit; in the default
  mode cuBLAS, the residual updated in place; and for a default-mode step of <= 256 tokens with
  ops/decode_linear.py's CONFIGS["enabled"], `Fused`: the same steps, but a norm and the GEMM after
  it are deferred to the step that consumes them, which then runs one kernel for all three (the
  input norm, the QKV GEMM and qkv_prep in ops/decode_qkv.py; the post norm, gate_up and SwiGLU in
  one decode_linear), and the residual adds go into o's and down's epilogues: five launches a
  layer instead of nine.
- `lora`, the step's adapters (engine/lora.py `LoraStep`: each token's slot, the grouped kernels),
  with which the schedule is the plain one (`schedule`); so is a Qwen3-MoE model's (its sparse
  layers' router reads the post norm's output, which `Fused` defers into gate_up's kernel);
then the final norm (`final`) and the LM head only on the rows that sample a token. The engine
keeps nothing for a backward, so no activation outlives its layer.

`kv` is the pool of engine/kv_pool.py: [2, layers, num_blocks, block_size, Hk, D].
"""

from __future__ import annotations

import torch

from rlcu.model import layer
from rlcu.model.causal_lm import Qwen3
from rlcu.ops.attention_exact import attention_exact_paged
from rlcu.ops.decode_linear import decode_linear, fused_for
from rlcu.ops.decode_qkv import decode_qkv
from rlcu.ops.embedding import embedding_fwd
from rlcu.ops.logprob import token_logprob
from rlcu.ops.matmul_invariant import mm as mm_invariant
from rlcu.ops.paged_attention import decode_work, paged_attention
from rlcu.ops.qkv_prep import qkv_prep
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.sampling import sample


def hidden(model: Qwen3, kv: torch.Tensor, ids, pos, kv_slots, block_tables, cu_q, seq_lens, max_q: int, max_k: int,
           rows=None, tiles=None, lora=None, routes=None) -> torch.Tensor:
    """ids, pos (int32), kv_slots (int64, -1: write nowhere): [N]; block_tables [S, W] int32;
    cu_q [S+1], seq_lens [S] int32; rows: [R] indices of the tokens whose logits are wanted (None: all);
    tiles: the prefill attention's tile list (ops/paged_attention.py `prefill_tiles`), or None;
    lora: the step's adapters (engine/lora.py `LoraStep`), or None; routes: a Qwen3-MoE engine's
    route log (engine/routes.py `RouteLog`: the rows' experts written by kv slot), or None ->
    final-normed hidden states [R, hidden]."""
    x = embedding_fwd(ids, model.w["embed"])
    # a decode step's attention work list, built once for every layer (None unless the decode
    # plan is the list kernel, ops/paged_decode_list.py)
    work = decode_work(cu_q, seq_lens, model.cfg.num_key_value_heads) if max_q == 1 and not model.exact else None
    cache = PagedKV(model, kv, kv_slots, block_tables, cu_q, seq_lens, max_q, max_k, tiles, work)
    ops = schedule(model, x.shape[0], lora is not None)
    rec = routes.step(kv_slots) if routes is not None else None
    for i in range(model.cfg.num_hidden_layers):
        x = layer.layer_fwd(model, i, x, pos, cache, ops, lora=lora, routes=rec)[0]
    return final(model, x, rows)


def schedule(model: Qwen3, N: int, adapters: bool = False):
    """The kernels a step of N tokens runs its layers' steps with (see the module docstring).
    With adapters, never `Fused`: it defers the input and post norms' outputs and the QKV and
    gate_up GEMMs' into their consumers' kernels, where the adapter's shrink (which reads the
    normed input) and expand (which adds into the GEMM's output before qkv_prep or SwiGLU) have
    no place; the adapter's own launches are a larger share of such a step than Fused saves.
    A mixture-of-experts model neither: the router and experts (model/moe.py) take the normed
    rows themselves, and a step's cost is the experts' weights, not its launches."""
    if not model.exact and not adapters and not model.cfg.fam.moe and fused_for(N):
        return FUSED
    return layer.Kernels(model.exact, in_place=True)


def final(model: Qwen3, x, rows=None) -> torch.Tensor:
    """The final norm of the rows `rows` of x (None: all)."""
    if rows is not None:
        x = x.index_select(0, rows)
    return rmsnorm_fwd(x, model.w["final_norm"], model.cfg.rms_norm_eps, exact=model.exact)[0]


class PagedKV:
    """K/V in the paged pool kv (model/layer.py's `kv` protocol): qkv_prep writes each token's k
    and v to its kv slot, attention reads the sequences' blocks. The arguments are `hidden`'s."""

    def __init__(self, model: Qwen3, kv, kv_slots, block_tables, cu_q, seq_lens, max_q: int, max_k: int,
                 tiles=None, work=None):
        self.cfg, self.exact, self.slots = model.cfg, model.exact, kv_slots
        self.inv_freq, self.mscale = model.inv_freq, model.rope_mscale
        self.tables, self.cu_q, self.seq_lens, self.max_q, self.max_k = block_tables, cu_q, seq_lens, max_q, max_k
        self.tiles, self.work = tiles, work
        self.caches = [(kv[0, i], kv[1, i]) for i in range(model.cfg.num_hidden_layers)]  # layer i's K, V

    def place(self, i: int, qkv, q_w, k_w, pos, bias=None):
        c, (kc, vc) = self.cfg, self.caches[i]
        args = (pos, self.slots, kc, vc, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        if isinstance(qkv, Projected):  # the input norm, the GEMM and qkv_prep in one kernel
            q = decode_qkv(qkv.x, qkv.w, qkv.norm_w, qkv.eps, q_w, k_w, *args, self.inv_freq, mscale=self.mscale,
                           bias=bias)
        else:  # exact mode asks for the stats: the variant the trainer's qk_norm_rope runs
            q = qkv_prep(qkv, q_w, k_w, *args, c.rms_norm_eps, self.inv_freq, self.exact, exact=self.exact,
                         mscale=self.mscale, bias=bias)
            q = q[0] if self.exact else q
        return q, None, None, None, None

    def attend(self, i: int, q, k, v):
        (kc, vc), scale = self.caches[i], self.cfg.head_dim**-0.5
        if self.exact:
            return attention_exact_paged(q, kc, vc, self.tables, self.cu_q, self.seq_lens, self.max_q, scale), None
        return paged_attention(q, kc, vc, self.tables, self.cu_q, self.seq_lens, self.max_q, self.max_k, scale,
                               self.tiles, self.work), None


class Normed:
    """rmsnorm(x; norm_w), not computed: the fused schedule's GEMM takes the norm in its prologue."""

    def __init__(self, x, norm_w, eps: float):
        self.x, self.norm_w, self.eps = x, norm_w, eps


class Projected(Normed):
    """rmsnorm(x; norm_w) w^T, not computed: its consumer (SwiGLU, or PagedKV's q/k norm and
    rope) runs the norm, the GEMM and itself as one kernel."""

    def __init__(self, n: Normed, w):
        super().__init__(n.x, n.norm_w, n.eps)
        self.w = w


class Fused:
    """The small-step schedule of the layer's steps (ops/decode_qkv.py, ops/decode_linear.py),
    default mode only: a norm and the GEMM after it are deferred (Normed, Projected) and run in
    the kernel of the step that consumes them; a residual add is the GEMM's epilogue, in place."""

    def norm(self, x, w, eps: float):
        return Normed(x, w, eps), None

    def linear(self, a, w, residual=None):
        if isinstance(a, Normed):
            return Projected(a, w)
        return decode_linear(a, w, residual=residual)

    def swiglu(self, gu: Projected):
        return decode_linear(gu.x, gu.w, gu.norm_w, gu.eps, None, True)


FUSED = Fused()


def logits(model: Qwen3, h: torch.Tensor) -> torch.Tensor:
    """[R, V] in the model's dtype (the sampler computes in fp32; as the trainer's logprob
    op does, the logits are rounded to the model's dtype first)."""
    if model.exact:
        return mm_invariant(h, model.lm_head)
    return h @ model.lm_head.t()


def sample_rows(model: Qwen3, h: torch.Tensor, samp: tuple):
    """The LM head and the sampler on final hidden rows -> (tokens, logprobs). In exact mode
    the logprob of each sampled token is the trainer's head kernel's on the same logits.
    samp: the sampler's per-row tensors (temperature, top_k, top_p, min_p, seeds, offsets)."""
    z = logits(model, h)
    tokens, logprobs = sample(z, *samp)
    if model.exact:
        logprobs = token_logprob(z, tokens, samp[0])
    return tokens, logprobs
