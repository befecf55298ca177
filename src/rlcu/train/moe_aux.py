"""A Qwen3-MoE model's load-balancing loss over a step's micro-batches: each micro-batch's share.

transformers defines the loss over one forward's rows (ops/moe_route.py aux_loss):

    aux(B) = E sum_e f_e(B) P_e(B),   f_e: the fraction of B's top-k picks that chose e,
                                      P_e: B's mean router probability of e (over its rows)

A step that runs its batch B as micro-batches B_1..B_M can only differentiate each one's own
aux(B_m): its backward runs before the next forward has counted anything. Adding
`router_aux_loss_coef` aux(B_m) for each (what the model does alone) makes the step's loss, and
its gradient, M times the one batch's: the load-balancing pull grows with the number of
micro-batches. Here micro-batch m's term is weighted by its share of the batch's tokens:

    loss_aux = coef sum_m (n_m / N) aux(B_m),   n_m: B_m's tokens, N: the batch's (every rank's)

which is the whole batch's coef aux(B) exactly when the micro-batches' loads f(B_m) agree (the
gradient of aux at a row's probabilities is coef E f_e / N_rows: the same for every row, from
the counts alone), and otherwise the mean of the micro-batches' balance, which is what
Megatron-LM's per-token loss (the aux loss scaled by the micro-batch's tokens over the batch's)
and its equal-micro-batch form (1 / num_microbatches) compute. It no longer scales with M; one
micro-batch is transformers' loss exactly. The logged `moe/aux_loss` is sum_m (n_m / N)
aux(B_m), summed over ranks, without the coefficient (the quantity the step differentiates).
"""

from __future__ import annotations

from rlcu.parallel.comm import all_sum


class AuxShare:
    """The step's load-balancing loss weights (module docstring) for `model` (a Qwen3, or a
    Critic's trunk) over a batch of `total` tokens (every rank's): `weigh(n)` before a micro-batch
    of n tokens runs its backward, `add(n)` after its forward; `metrics()` once per step, on every
    rank (a collective). Inert for a dense model or a zero coefficient."""

    def __init__(self, model, total: int):
        self.model, self.total = model, max(int(total), 1)
        self.coef = model.cfg.aux_coef
        self.loss = 0.0
        self.on = bool(model.cfg.fam.moe)

    def weigh(self, n: int) -> None:
        if self.on:
            self.model.aux_weight = self.coef * n / self.total

    def add(self, n: int) -> None:
        if self.on and self.model.aux_loss is not None:
            self.loss += float(self.model.aux_loss) * n / self.total

    def done(self) -> None:
        """Back to the model's own weight (cfg.aux_coef: transformers', one forward alone)."""
        if self.on:
            self.model.aux_weight = None

    def metrics(self) -> dict:
        return {"moe/aux_loss": float(all_sum(self.loss))} if self.on else {}
