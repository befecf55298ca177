"""Qwen3-MoE's sparse MLP as a step of the one layer (model/layer.py), forward and backward.

    logits = h2 Wr^T                            the router, through the schedule's GEMM ([N, E])
    ids, w, probs = route(logits)               softmax in fp32, top-k (ties: the lower id), renorm
    y = x2 + sum_s w[:, s] expert_{ids[:, s]}(h2)   SwiGLU experts, combined in slot order

The kernels are ops/moe.py's: batch invariant as they are, so the engine and the trainer route
every token alike in exact mode where the router's input and GEMM are the same bits (the router
GEMM is the schedule's `linear`: the batch-invariant one in exact mode).

What a layer keeps. A checkpointed layer keeps its router logits beside its input
(`router_logits`, [N, E] in the activations' dtype): the backward's recompute runs in the default
mode's kernels, whose h2 may differ from the forward's in the last bits, and a token near a tie
could then take other experts; routing the recompute from the kept logits gives it the forward's
experts and weights exactly. Every training forward also keeps the layer's share of the
load-balancing loss (`aux`: ops/moe_route.py aux_stats, C and P [E] fp32), which the trunk sums
over the sparse layers before the backward: the loss's gradient at every row needs every layer's
counts (`aux_dprobs`): `trunk_aux`.
"""

from __future__ import annotations

import torch

from rlcu.ops._matmul import acc_wgrad
from rlcu.ops.moe import aux_loss, aux_stats, experts_bwd, experts_fwd, route_bwd, route_fwd


def mlp_fwd(model, i: int, h2: torch.Tensor, x2: torch.Tensor, ops, keep: str, router_logits=None, routes=None,
            lora=None):
    """Sparse layer i's MLP on the post-normed h2 [N, H] with the residual x2 [N, H] -> (y [N, H],
    kept: None for keep 'none', else {router_logits, aux} and, for 'all', what `mlp_bwd` reads).
    router_logits: the forward's (a checkpointed layer's recompute), else the router GEMM's.
    routes: who chooses the experts from the logits (model/routes.py `Routes`, the engine's
    engine/routes.py `RouteLog`: `route(i, logits, k, norm) -> (ids, weights, probs)`), None: route_fwd.
    lora: the layer's adapters (model/lora_run.py LoraRun, engine/lora.py LoraStep), whose
    `experts(i)` gives the experts' (ops/moe.py ExpertLora) or None, and `apply(i, "router", ...)`
    adds the router's, where targeted."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    if router_logits is None:
        logits = ops.linear(h2, w[p + "router"])  # [N, E]
        if lora is not None:  # the router's adapter, where targeted (a kept recompute's logits hold it)
            lora.apply(i, "router", h2, logits)
    else:
        logits = router_logits
    route = route_fwd if routes is None else (lambda *a: routes.route(i, *a))
    ids, wts, probs = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
    el = lora.experts(i) if lora is not None else None
    out, saved = experts_fwd(h2, ids, wts, w[p + "experts_gate_up"], w[p + "experts_down"], exact=ops.exact, lora=el)
    y = x2.add_(out) if ops.in_place else x2 + out
    if keep == "none":
        return y, None
    kept = dict(router_logits=logits, aux=aux_stats(probs, saved.layout.counts))
    if keep == "all":
        kept.update(ids=ids, wts=wts, probs=probs, moe=saved)
    return y, kept


def mlp_bwd(model, i: int, dy: torch.Tensor, s: dict, g: dict | None, daux: torch.Tensor | None,
            lora=None) -> torch.Tensor:
    """dy [N, H] (the gradient of y, which is also x2's through the residual) -> dh2 [N, H];
    the experts' and the router's weight gradients accumulated into g (None: a frozen base, none).
    daux [E] fp32: the load-balancing loss's gradient at each row's probabilities (ops/moe_route.py
    aux_dprobs), None without it. s: `mlp_fwd`'s kept activations of keep 'all', with h2. lora:
    the trainer's LoraRun, whose `expert_grads(i)` take the expert adapters' gradients and
    `backward(i, "router", ...)` the router adapter's."""
    c, w, p = model.cfg, model.w, f"layers.{i}."
    wgu, wd = w[p + "experts_gate_up"], w[p + "experts_down"]
    dgu, dd = (g[p + "experts_gate_up"], g[p + "experts_down"]) if g is not None else (None, None)
    lg = lora.expert_grads(i) if lora is not None and s["moe"].lora is not None else None
    dh2, dweights = experts_bwd(dy, s["h2"], s["wts"], wgu, wd, s["moe"], dgu, dd, lg)
    dlogits = route_bwd(dweights, s["probs"], s["ids"], s["wts"], c.norm_topk_prob, daux)  # [N, E] fp32
    dlogits = dlogits.to(dy.dtype)  # the logits are the GEMM's output, in the activations' dtype
    if g is not None:
        acc_wgrad(g[p + "router"], dlogits, s["h2"])
    dh2 = dh2.addmm_(dlogits, w[p + "router"])
    return dh2 if lora is None else lora.backward(i, "router", s["h2"], dlogits, dh2)


def trunk_aux(saved: list[dict], N: int):
    """A training forward's load-balancing loss over its N tokens: its sparse layers' kept aux
    stats summed (ops/moe_route.py aux_loss) -> (the loss, the summed counts C [E], the rows L N),
    which the backward's `aux_dprobs` reads; None where no layer kept any (a dense model)."""
    stats = [s["aux"] for s in saved if "aux" in s]
    if not stats:
        return None
    C, P = (torch.stack(t).sum(0) for t in zip(*stats))
    rows = N * len(stats)
    return aux_loss(C, P, rows), C, rows
