"""A Qwen3-MoE policy's routing between the rollout and the trainer: the disagreement metric
and routing replay (config `moe.routing`).

The engine returns each completion's routes, the experts of its prompt's and completion's rows
but the last (engine/routes.py); `pack_routes` lays them along the packed batch as
`fields["routes"]` [N, Ls, k] int16 (-1 on each sequence's last row, which the engine never
ran). The trainer's forwards take a model/routes.py `Routes` (`routes_for`), which records the
trainer's own top-k of every row and, with replay (`fields["replay_routes"]`, the same tensor),
sends each row to the engine's experts: the policy update's forward and its recompute, and the
old-logprobs pass (rollout.batch_logprobs). The reference model's pass reads the same batch and
replays the same choice: the KL then compares the two policies along one routing.

Metric (`RouteMismatch`, the first update's forward, whose weights are the rollout's): over the
rows that predict a completion token (row t - 1 of completion token t: what the loss reads), a
row of a sparse layer disagrees when its set of k experts differs from the engine's (order
within the top-k aside: near-equal weights may swap slots without changing the output's terms).
    moe/route_mismatch           mean over the sparse layers of each layer's disagreeing fraction
    moe/route_mismatch_any       fraction of rows that disagree in at least one layer
    moe/route_mismatch_layer_max the largest layer's fraction
In exact mode both sides run the same batch-invariant kernels on the same bits: 0 by construction.
With replay the metric still compares the trainer's own choice (what replay overrode).
"""

from __future__ import annotations

import torch

from rlcu.model.routes import Routes
from rlcu.parallel.comm import all_sum

REPLAY = "replay_routes"


def pack_routes(samples, cfg, device) -> torch.Tensor | None:
    """[N, Ls, k] int16 of the packed samples (prompt then completion each, as rollout.pack):
    each sample's engine routes (Sample.routes), -1 where it has none (its last row; a sample
    without routes, e.g. an episode's). None for a dense model."""
    if not cfg.fam.moe:
        return None
    Ls, k = len(cfg.sparse_layers), cfg.num_experts_per_tok
    parts = []
    for s in samples:
        n = len(s.prompt_ids) + len(s.completion_ids)
        r = torch.full((n, Ls, k), -1, dtype=torch.int16, device=device)
        if s.routes is not None:
            m = min(s.routes.shape[0], n - 1)
            r[:m] = s.routes[:m].to(device=device, dtype=torch.int16)
        parts.append(r)
    return torch.cat(parts) if parts else torch.empty(0, Ls, k, dtype=torch.int16, device=device)


def routes_for(model, mb) -> Routes | None:
    """The `routes` of a forward over the micro-batch mb (a rollout.RolloutBatch): a record of the
    trainer's choices, replaying the engine's where the batch asks (fields["replay_routes"]); None
    for a dense model or a batch without routes."""
    if "routes" not in mb.fields or not model.cfg.fam.moe:
        return None
    return Routes(model.cfg, mb.num_tokens, mb.tokens.device, mb.fields.get(REPLAY))


class RouteMismatch:
    """The step's disagreement between the engine's routes and the trainer's (module docstring),
    summed on the device over the recorded micro-batches, read once at `metrics`."""

    def __init__(self, cfg, device):
        # [Ls + 2]: each layer's disagreeing rows, rows disagreeing anywhere, rows; None: a dense model
        self.sums = torch.zeros(len(cfg.sparse_layers) + 2, dtype=torch.float64, device=device) \
            if cfg.fam.moe else None

    def record(self, mb, routes: Routes | None) -> None:
        """mb: the micro-batch the forward ran on; routes: its `routes_for` after the forward."""
        if routes is None:
            return
        rows = mb.completion_index() - 1  # the rows that predict completion tokens
        eng = mb.fields["routes"].index_select(0, rows)
        own = routes.taken.index_select(0, rows)
        valid = eng[:, 0, 0] >= 0
        diff = (eng.sort(-1).values != own.sort(-1).values).any(-1) & valid[:, None]  # [R, Ls]
        self.sums += torch.cat([diff.sum(0), diff.any(1).sum()[None], valid.sum()[None]]).double()

    def metrics(self) -> dict[str, float]:
        """The step's moe/ metrics, summed over the ranks (every rank calls it); {} for a dense model."""
        if self.sums is None:
            return {}
        s = all_sum(self.sums.cpu())
        n = max(float(s[-1]), 1.0)
        per_layer = s[:-2] / n
        return {"moe/route_mismatch": float(per_layer.mean()), "moe/route_mismatch_any": float(s[-2]) / n,
                "moe/route_mismatch_layer_max": float(per_layer.max())}
