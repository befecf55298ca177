"""A forward's expert choices on Qwen3-MoE's sparse layers: recorded, and replayed from elsewhere.

Routes of N tokens are one tensor [N, Ls, k] (Ls: the sparse layers, in order; k the experts of a
token, in route_fwd's slot order), small integers (`route_dtype`: uint8 for E <= 256): 384 bytes
a token at Qwen3-30B-A3B's 48 layers x 8. The engine records its routes into such rows by KV slot
(engine/routes.py); the trainer's forward takes a `Routes` (layer.layer_fwd's `routes`) that

- records the trainer's own top-k of every row (`taken`, int16), for the step's disagreement
  metric against the rollout's (train/moe_routes.py), and
- with `replay` given ([N, Ls, k], -1 in a row's slot 0: no choice there, the row routes itself),
  sends every other row to the replayed experts, the weights recomputed from this router's own
  logits over them (ops/moe_route.py route_replay; as slime and verl's routing replay do): a token
  takes the same experts in the trainer as in the rollout, and the router's gradient flows through
  the replayed choice (route_bwd differentiates the weights of any ids).

`taken` holds the router's own choice even where a replayed one is used: the metric says how
often replay overrode the trainer. A checkpointed layer's recompute passes the same object, so it
replays as its forward did (its own choice recomputed from the kept logits: the same bits).
"""

from __future__ import annotations

import torch

from rlcu.ops.moe import route_fwd, route_replay


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer holding an expert id."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class Routes:
    """One forward's routing record and replay (module docstring). cfg: the model's config;
    N: its tokens; replay: None or [N, Ls, k] integers (-1 in slot 0: the row routes itself)."""

    def __init__(self, cfg, N: int, device, replay: torch.Tensor | None = None):
        self.layer = {i: j for j, i in enumerate(cfg.sparse_layers)}
        Ls, k = len(self.layer), cfg.num_experts_per_tok
        if replay is not None and (replay.dim() != 3 or tuple(replay.shape) != (N, Ls, k)):
            raise ValueError(f"Routes: replay must be [{N}, {Ls}, {k}] (tokens, sparse layers, top-k), "
                             f"got {list(replay.shape)}")
        self.replay = replay
        self.taken = torch.full((N, Ls, k), -1, dtype=torch.int16, device=device)

    def route(self, i: int, logits: torch.Tensor, k: int, norm: bool):
        """Sparse layer i's (ids, weights, probs) for its router logits [N, E]."""
        j = self.layer[i]
        ids, wts, probs = route_fwd(logits, k, norm)
        self.taken[:, j] = ids
        if self.replay is None:
            return ids, wts, probs
        r = self.replay[:, j].to(torch.int32)
        ids = torch.where(r[:, :1] >= 0, r, ids).contiguous()
        wts, probs = route_replay(logits, ids, norm)
        return ids, wts, probs
