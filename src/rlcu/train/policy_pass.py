"""One micro-batch of a policy update: the forward, the fused policy loss and the backward,
under the ratio `importance_sampling_level` chooses (docs/estimators.md).

token: the loss is elementwise, so `model.forward_backward` applies it chunk by chunk inside
the LM head's sweep and each chunk takes its gradient while its logits are in memory (no
second sweep of the head).

sequence, sequence_token (GSPO): every token's gradient reads its sequence's whole ratio
exp(mean log-ratio), which exists only once the sequence's every logprob does, so the loss
cannot ride the head's sweep. `model.forward` keeps the head's inputs (hidden rows,
log-sum-exp), `rlcu.ops.rl_loss.sequence_policy_loss` takes the sequences' ratios and the
gradient, and `model.backward` recomputes the head's logits chunk by chunk once more: one extra
head matmul, no extra trunk pass, since a micro-batch never splits a sequence.
"""

from __future__ import annotations

import torch

from rlcu.ops.rl_loss import policy_loss, sequence_policy_loss


def policy_pass(model, cfg, mb, w: torch.Tensor, kl_coef: float, routes) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the micro-batch `mb`'s policy loss (token weights w [N]) into the model's
    buffers. cfg: the RL config (clip, temperature, entropy, the ratio's level). Returns
    (lp [N] at the weights before the update, stats [len(POLICY_STATS)])."""
    if cfg.importance_sampling_level == "token":
        return _token_pass(model, cfg, mb, w, kl_coef, routes)
    return _sequence_pass(model, cfg, mb, w, kl_coef, routes)


def _token_pass(model, c, mb, w, kl_coef, routes):
    ref, adv, bw = mb.fields.get("ref_lp"), mb.fields["adv"], mb.fields.get("is_w")
    parts = []

    def grad_fn(lp_c, ent_c, idx):
        _, dlp, dent, st = policy_loss(lp_c, mb.old_lp[idx], None if ref is None else ref[idx], adv[idx], w[idx],
                                       ent_c, clip_low=c.clip_low, clip_high=c.clip_high, kl_coef=kl_coef,
                                       entropy_coef=c.entropy_coef, is_w=None if bw is None else bw[idx])
        parts.append(st)
        return dlp, (dent if c.entropy_coef > 0 else None)

    lp, _ = model.forward_backward(mb.tokens, mb.cu_seqlens, grad_fn, temperature=c.temperature,
                                   return_entropy=True, routes=routes)
    return lp, torch.stack(parts).sum(0)


def _sequence_pass(model, c, mb, w, kl_coef, routes):
    kw = {} if routes is None else {"routes": routes}
    lp, ent = model.forward(mb.tokens, mb.cu_seqlens, temperature=c.temperature, return_entropy=True, **kw)
    _, dlp, dent, st = sequence_policy_loss(lp, mb.old_lp, mb.fields.get("ref_lp"), mb.fields["adv"], w,
                                            mb.cu_seqlens, ent, level=c.importance_sampling_level,
                                            clip_low=c.clip_low, clip_high=c.clip_high, kl_coef=kl_coef,
                                            entropy_coef=c.entropy_coef, is_w=mb.fields.get("is_w"))
    model.backward(dlp, dent if c.entropy_coef > 0 else None)
    return lp, st
