"""What fits: the fewest checkpointed layers within a budget (`gradient_checkpointing: auto`), the
KV blocks within a budget (the engine's pool, a scheduled job's rollout lease), and the KV blocks
one RL step's sequences need."""

from __future__ import annotations

from rlcu.memory import parts
from rlcu.memory.job import FRAGMENTATION, job_memory
from rlcu.memory.shape import JobShape


def fit_checkpointing(budget_bytes: int, shape: JobShape) -> int:
    """The fewest checkpointed layers k whose peak (`job_memory(shape with k)`, with the
    allocator's fragmentation) is within budget_bytes; every layer when none fits (the caller's
    out-of-memory to meet). The peak falls as k grows, so a bisection finds it."""
    lo, hi = 0, shape.cfg.num_hidden_layers
    while lo < hi:
        mid = (lo + hi) // 2
        if job_memory(shape.with_(checkpointing=mid)).peak * FRAGMENTATION <= budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return lo


def kv_blocks_within(free_bytes: float, shape: JobShape, block_size: int, *, step_bytes: int | None = None,
                     decode_graph_bytes: int | None = None) -> int:
    """KV blocks of `block_size` tokens that fit in `free_bytes` once the engine's widest step
    and its graphs' pools are set aside (`shape.engine`; its kv_tokens are not read).
    step_bytes, decode_graph_bytes: measured (engine/kv_pool.py probes them), else modelled;
    pass decode_graph_bytes=0 where the decode graphs' pool is counted elsewhere (a scheduled
    job's resident memory)."""
    step = parts.engine_step(shape) if step_bytes is None else step_bytes
    graphs = parts.decode_graphs(shape) if decode_graph_bytes is None else decode_graph_bytes
    left = free_bytes - step - graphs - parts.prefill_graphs(shape, step_bytes)
    return int(left // parts.kv_block_bytes(shape.cfg, block_size, shape.engine.kv_bytes))


def kv_blocks_for_lease(lease_bytes: float, shape: JobShape, block_size: int) -> int:
    """The KV pool a scheduled job's rollout lease holds: the lease (which the scheduler granted
    as `JobMemory.request`, fragmentation included) less the rollout's other parts; the
    decode graphs' pool is in the resident lease."""
    return kv_blocks_within(round(lease_bytes / FRAGMENTATION), shape, block_size, decode_graph_bytes=0)


def step_kv_blocks(longest_prompt: int, max_new_tokens: int, block_size: int, seqs: int) -> int:
    """The KV pool of one RL step: `seqs` sequences of the longest prompt and every new token
    (and the last sampled one), one sequence more and 16 blocks to spare, so that the rollout
    never preempts for want of blocks and holds no more."""
    per_seq = -(-(longest_prompt + max_new_tokens + 1) // block_size)
    return per_seq * (seqs + 1) + 16
