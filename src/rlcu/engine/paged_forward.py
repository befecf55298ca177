"""The model's forward over the paged KV cache, and the LM head and sampler on its last rows:
what one engine step computes, whatever its mix of prefill chunks and decodes.

The forward reads the model's weight views (`model.w`) at every step, never a copy: an
optimizer step that updates `model.flat` in place is seen by the next step (CUDA graphs
captured on those views see it too, since the addresses do not change; if `model.flat` is
replaced by another tensor the graphs are captured again, engine/graphs.py).

Per layer, over the N new tokens of the step (packed, any mix of prefill chunks and decodes):
    h = rmsnorm(x); q, k, v = h Wqkv^T; q, k = rope(rmsnorm(q)), rope(rmsnorm(k)) at their positions
    (qkv_prep, one kernel: q, k normed and rotated, k and v written to their kv slots)
    o = paged_attention(q, cache); x += o Wo^T
    x += swiglu(rmsnorm(x) Wgu^T) Wd^T
(a layer's parts before and after its attention are `attention_inputs` and `attention_out`;
with ops/decode_linear.py's CONFIGS["enabled"], a step of <= 256 tokens runs its projections
through that op and ops/decode_qkv.py instead: the input norm, the QKV GEMM and qkv_prep in one
kernel, the post norm and SwiGLU inside gate_up, the residual adds in o's and down's epilogues:
five launches a layer instead of nine)
then the final norm (`final`) and the LM head only on the rows that sample a token. In exact mode
(the model's `exact`, read at every step; ops/exact.py) `hidden_exact` runs the trainer's ops in
the trainer's order instead (qkv_prep with its stats, as the trainer's forward runs it, the
batch-invariant GEMM, the exact attention over the cache) and the sampled token's logprob is
taken by the trainer's head kernel (`sample_rows`).

`kv` is the pool of engine/kv_pool.py: [2, layers, num_blocks, block_size, Hk, D].
"""

from __future__ import annotations

import torch

from rlcu.model.qwen3 import Qwen3
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
from rlcu.ops.swiglu import swiglu_fwd


def hidden(model: Qwen3, kv: torch.Tensor, ids, pos, kv_slots, block_tables, cu_q, seq_lens, max_q: int, max_k: int,
           rows=None, tiles=None) -> torch.Tensor:
    """ids, pos (int32), kv_slots (int64, -1: write nowhere): [N]; block_tables [S, W] int32;
    cu_q [S+1], seq_lens [S] int32; rows: [R] indices of the tokens whose logits are wanted (None: all);
    tiles: the prefill attention's tile list (ops/paged_attention.py `prefill_tiles`), or None
    -> final-normed hidden states [R, hidden]."""
    c, w = model.cfg, model.w
    scale = c.head_dim**-0.5
    x = embedding_fwd(ids, w["embed"])
    if model.exact:
        return hidden_exact(model, kv, x, pos, kv_slots, block_tables, cu_q, seq_lens, max_q, rows)
    # a decode step's attention work list, built once for every layer (None unless the decode
    # plan is the list kernel, ops/paged_decode_list.py)
    work = decode_work(cu_q, seq_lens, c.num_key_value_heads) if max_q == 1 else None
    for i in range(c.num_hidden_layers):
        q = attention_inputs(model, kv, i, x, pos, kv_slots)
        o = paged_attention(q, kv[0, i], kv[1, i], block_tables, cu_q, seq_lens, max_q, max_k, scale, tiles, work)
        attention_out(model, i, x, o)
    return final(model, x, rows)


def final(model: Qwen3, x, rows=None) -> torch.Tensor:
    """The final norm of the rows `rows` of x (None: all)."""
    if rows is not None:
        x = x.index_select(0, rows)
    return rmsnorm_fwd(x, model.w["final_norm"], model.cfg.rms_norm_eps, exact=model.exact)[0]


def attention_inputs(model: Qwen3, kv: torch.Tensor, i: int, x, pos, kv_slots) -> torch.Tensor:
    """Layer i up to its attention: the input norm, the fused QKV projection, and qkv_prep
    (q, k normed and rotated, k and v written to their kv slots) -> q [N, Hq, D]."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    if fused_for(x.shape[0]):  # the norm, the GEMM and qkv_prep in one kernel (ops/decode_qkv.py)
        return decode_qkv(x, w[p + "qkv"], w[p + "input_norm"], c.rms_norm_eps, w[p + "q_norm"], w[p + "k_norm"],
                          pos, kv_slots, kv[0, i], kv[1, i], c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, c.rope_theta)
    h, _ = rmsnorm_fwd(x, w[p + "input_norm"], c.rms_norm_eps)
    qkv = h @ w[p + "qkv"].t()  # [N, (Hq + 2 Hk) D]
    return qkv_prep(qkv, w[p + "q_norm"], w[p + "k_norm"], pos, kv_slots, kv[0, i], kv[1, i],
                    c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta)


def attention_out(model: Qwen3, i: int, x, o) -> None:
    """Layer i from its attention's output o [N, Hq, D] on, in place on the residual x:
    x += o Wo^T; x += swiglu(rmsnorm(x) Wgu^T) Wd^T."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    if fused_for(x.shape[0]):  # few rows: the norm and SwiGLU inside the GEMMs (ops/decode_linear.py)
        decode_linear(o.view(x.shape[0], c.q_size), w[p + "o"], None, c.rms_norm_eps, x)
        a = decode_linear(x, w[p + "gate_up"], w[p + "post_norm"], c.rms_norm_eps, None, True)
        decode_linear(a, w[p + "down"], None, c.rms_norm_eps, x)
        return
    x.addmm_(o.view(x.shape[0], c.q_size), w[p + "o"].t())  # in place: no copy of x for cuBLAS's C
    h, _ = rmsnorm_fwd(x, w[p + "post_norm"], c.rms_norm_eps)
    x.addmm_(swiglu_fwd(h @ w[p + "gate_up"].t()), w[p + "down"].t())


def hidden_exact(model: Qwen3, kv: torch.Tensor, x, pos, kv_slots, block_tables, cu_q, seq_lens, max_q: int,
                 rows) -> torch.Tensor:
    """Exact mode's layers (ops/exact.py): the trainer's ops in the trainer's order (the q/k
    norm and rope by the fused kernel that Qwen3._layer_fwd runs in exact mode too), the
    batch-invariant GEMM, and the attention kernel the trainer runs, over the paged cache."""
    c, w = model.cfg, model.w
    N, Hq, Hk, D, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    qs = c.q_size
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h, _ = rmsnorm_fwd(x, w[p + "input_norm"], eps, exact=True)
        qkv = mm_invariant(h, w[p + "qkv"])  # [N, (Hq + 2 Hk) D]
        kc, vc = kv[0, i], kv[1, i]
        # the kernel the trainer's forward runs (qk_norm_rope), its stats included
        q = qkv_prep(qkv, w[p + "q_norm"], w[p + "k_norm"], pos, kv_slots, kc, vc, Hq, Hk, D, eps,
                     c.rope_theta, True, exact=True)[0]
        o = attention_exact_paged(q, kc, vc, block_tables, cu_q, seq_lens, max_q, D**-0.5)
        mm_invariant(o.view(N, qs), w[p + "o"], x, out=x)  # x += o Wo^T, in place
        h, _ = rmsnorm_fwd(x, w[p + "post_norm"], eps, exact=True)
        mm_invariant(swiglu_fwd(mm_invariant(h, w[p + "gate_up"]), exact=True), w[p + "down"], x, out=x)
    return final(model, x, rows)


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
