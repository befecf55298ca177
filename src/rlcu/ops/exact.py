"""Exact on-policy mode: with it on, every op on the engine's path and the trainer's is
batch-invariant, with shared reduction orders, so that the engine's logprob of a sampled token
is bit for bit `Qwen3.forward`'s.

The mode belongs to the model that the trainer and the engine share, not to the process:
`Qwen3(..., exact=True)`, `Qwen3.from_pretrained(path, exact=True)` or `model.exact = True`
(what an RL trainer does from `exact: true` in its config), and `rlcu.LLM(path, exact=True)` for
the engine alone. Two models of one process may run in different modes. The model and the
engine pass it on to each op as `exact=`; no op reads a global.

What changes with it on (the default mode's kernels and speed are untouched when off):
- every forward matmul goes through `matmul_invariant.mm` (fixed tiles and K order, no
  split-K: a row's result does not depend on how many rows there are);
- attention, in training and in the engine (chunked prefill and decode alike), goes through
  `attention_exact` (one kernel: fixed KV tiles from position 0, combined in order);
- the engine's q/k norm and rope (`qkv_prep`) store their stats, as the trainer's forward
  (`qk_norm_rope`, the same kernel in either mode) does, so that the two compile one kernel;
- the engine's logprob of a sampled token is taken by the trainer's fused-head kernel on the
  same logits (`logprob.token_logprob`), not by the sampler's own log-softmax.

On the CPU twins every reduction of those ops is a fixed halving tree (`tree_sum`): zero
padding does not change it, so a row's sum is the same whatever its length is padded to.
"""

from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed halving tree (x[:h] + x[h:], zero-padded to a power of
    two): elementwise adds only, so each row's result depends on its own values alone, and
    padding a row with more zeros gives the same bits."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], p - n)], -1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]
