"""The engine's expert choices, kept by KV slot, so that a rollout returns them (Qwen3-MoE).

A sequence's routes ([tokens, Ls, k], model/routes.py) are what the trainer compares its own
choices with (the step's disagreement metric) and, with routing replay, takes. Recording them by
KV slot costs the hot path no host sync and no bookkeeping: every step writes its rows' top-k of
each sparse layer where its K/V go (`buf[layer, slot]`, one index_copy a layer, inside the decode
and prefill graphs, a padded row's slot -1 to a spare row), and a slot's routes live exactly as
long as its K/V: a prefix served from the cache has its routes there (the same tokens, positions
and weights), a shared block copied on write copies its routes too (`copy_blocks`), a preempted
sequence's recompute writes them again. When a sequence retires, before
its blocks are freed, `gather` copies its rows' routes out on the device (one small index
upload and one gather, ordered on the stream behind the steps that wrote them).

Bytes: Ls x k a token (uint8 ids for E <= 256): 384 bytes at Qwen3-30B-A3B (48 layers x 8),
against 96 KiB of its K/V (0.4%). The buffer is allocated and released with the KV pool.
"""

from __future__ import annotations

import torch

from rlcu.memory import parts
from rlcu.model.routes import route_dtype
from rlcu.ops.moe import route_fwd


def bytes_per_token(cfg) -> int:
    """The route log's bytes a KV slot (0 for a dense model): the memory model's, which counts them
    in the KV pool's bytes a token."""
    return parts.route_token_bytes(cfg)


class RouteLog:
    """buf [Ls, slots + 1, k]: the routes of every KV slot (the last row: padded rows' writes)."""

    def __init__(self, cfg, num_slots: int, device):
        self.layer = {i: j for j, i in enumerate(cfg.sparse_layers)}
        self.num_slots = num_slots
        self.buf = torch.zeros(len(self.layer), num_slots + 1, cfg.num_experts_per_tok,
                               dtype=route_dtype(cfg.num_experts), device=device)

    def step(self, kv_slots: torch.Tensor) -> _StepRoutes:
        """The recorder of one step whose rows write K/V to kv_slots [N] (int64, -1: nowhere)."""
        return _StepRoutes(self, torch.where(kv_slots < 0, self.num_slots, kv_slots))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Blocks src's routes to blocks dst (the KV pool's copy on write of a shared partial block)."""
        Ls, _, k = self.buf.shape
        blocks = self.buf[:, : self.num_slots].view(Ls, -1, block_size, k)
        blocks[:, dst] = blocks[:, src]

    def gather(self, slots: list[int]) -> torch.Tensor:
        """The routes [n, Ls, k] at slots (a retiring sequence's rows, in order), on the device."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.buf.device.type == "cuda":
            idx = idx.pin_memory().to(self.buf.device, non_blocking=True)
        return self.buf.index_select(1, idx).permute(1, 0, 2).contiguous()


class _StepRoutes:
    """model/moe.py's `routes` for one engine step: route_fwd, its ids written by slot."""

    def __init__(self, log: RouteLog, idx: torch.Tensor):
        self.log, self.idx = log, idx

    def route(self, i: int, logits: torch.Tensor, k: int, norm: bool):
        ids, wts, probs = route_fwd(logits, k, norm)
        b = self.log.buf[self.log.layer[i]]
        b.index_copy_(0, self.idx, ids.to(b.dtype))
        return ids, wts, probs


def sequence_slots(block_table: list[int], block_size: int, n: int) -> list[int]:
    """The KV slots of a sequence's first n tokens."""
    return [block_table[t // block_size] * block_size + t % block_size for t in range(n)]
