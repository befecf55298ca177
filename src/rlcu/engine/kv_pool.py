"""The paged KV pool: its size, the tensor, and giving its memory back.

One tensor [2, layers, num_blocks, block_size, Hk, D] (K and V of every layer; a block holds
block_size tokens' keys and values, engine/block_manager.py hands blocks out). Its bytes, and
what an engine sets aside beside it, are the memory model's (rlcu.memory: `engine_shape` is an
engine's shape there). On CUDA its size is what `gpu_memory_utilization` of the device's memory
leaves after everything already allocated (the trainer's buffers too), the activations of a step
of the full token budget and, with graphs, the graphs' private pools (the decode graphs': about
one decode step of `max_num_seqs` rows; the prefill graphs': about one full-budget step,
engine/prefill_graphs.py): the step and the widest decode step are measured by running them over
a one-block pool (`probe_memory`). Off CUDA it holds 4 longest sequences (or the token budget),
at most `CPU_KV_BYTES`.
"""

from __future__ import annotations

import torch

from rlcu.engine import paged_forward, warmup
from rlcu.engine.graphs import context_bucket
from rlcu.engine.prefill_graphs import kept_output_rows
from rlcu.memory import EngineShape, JobShape, parts
from rlcu.memory.fit import kv_blocks_within
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config

CPU_KV_BYTES = 1 << 30  # the largest default KV pool on the CPU (gpu_memory_utilization does not apply there)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def block_bytes(cfg: Qwen3Config, block_size: int, dtype: torch.dtype) -> int:
    """The bytes of one block: K and V of block_size tokens in every layer (rlcu.memory)."""
    return parts.kv_block_bytes(cfg, block_size, dtype_bytes(dtype))


def engine_shape(cfg: Qwen3Config, dtype: torch.dtype, *, kv_tokens: int, max_num_seqs: int,
                 max_num_batched_tokens: int, graphs: bool, prefill_graphs: bool) -> JobShape:
    """An engine on its model as the memory model sees it (no optimizer): its KV pool's tokens,
    its widest steps, and the graphs it captures (prefill graphs only with graphs)."""
    e = EngineShape(kv_tokens=kv_tokens, kv_bytes=dtype_bytes(dtype), max_num_seqs=max_num_seqs,
                    budget=max_num_batched_tokens, decode_graphs=graphs,
                    prefill_graph_rows=kept_output_rows(max_num_batched_tokens) if graphs and prefill_graphs else None)
    return JobShape(cfg, weight_bytes=dtype_bytes(dtype), optimizer=False, engine=e)


def new_pool(cfg: Qwen3Config, num_blocks: int, block_size: int, device, dtype: torch.dtype) -> torch.Tensor:
    """The pool, zeroed: [2, layers, num_blocks, block_size, Hk, D]."""
    return torch.zeros(2, cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                       device=device, dtype=dtype)


def give_back(device: torch.device) -> None:
    """Return the memory of a dropped pool to the device, once this engine's stream is done
    with it."""
    if device.type == "cuda":
        # this engine's stream only: jobs sharing the device on their own streams go on
        torch.cuda.current_stream(device).synchronize()
        torch.cuda.empty_cache()


def auto_num_blocks(model: Qwen3, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                    max_model_len: int, gpu_memory_utilization: float, graphs: bool,
                    prefill_graphs: bool = False) -> tuple[int, dict]:
    """The pool's size when none is given -> (blocks, what the sizing set aside: {} off CUDA,
    else {"activation_bytes", "graph_bytes", "prefill_graph_bytes"})."""
    bb = block_bytes(model.cfg, block_size, model.dtype)
    if model.device.type != "cuda":  # room for 4 longest sequences (or the token budget), at most 1 GiB
        want = -(-max(4 * max_model_len, max_num_batched_tokens) // block_size)
        return max(min(want, CPU_KV_BYTES // bb), 1), {}
    dev = model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    activations, graph_bytes = probe_memory(model, block_size=block_size, max_num_seqs=max_num_seqs,
                                            max_num_batched_tokens=max_num_batched_tokens,
                                            max_model_len=max_model_len, graphs=graphs)
    shape = engine_shape(model.cfg, model.dtype, kv_tokens=0, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, graphs=graphs, prefill_graphs=prefill_graphs)
    probe = {"activation_bytes": activations, "graph_bytes": graph_bytes,
             "prefill_graph_bytes": parts.prefill_graphs(shape, activations)}
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    n = kv_blocks_within(total * gpu_memory_utilization - (total - free), shape, block_size, step_bytes=activations,
                         decode_graph_bytes=graph_bytes)
    if n < 1:
        gib = 1 << 30
        raise RuntimeError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache: "
            f"{(total - free) / gib:.1f} GiB of {total / gib:.1f} GiB in use, {activations / gib:.2f} GiB "
            f"for activations, {(graph_bytes + probe['prefill_graph_bytes']) / gib:.2f} GiB for the graphs; "
            "raise gpu_memory_utilization, "
            "lower max_num_batched_tokens, or free memory")
    return n, probe


def probe_memory(model: Qwen3, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, graphs: bool) -> tuple[int, int]:
    """Peak memory of a step of the full token budget (its forward and sampling) and, with
    graphs, of the widest decode step (the graphs' private pool holds about that: the largest
    graph is captured first and the others reuse its memory), each over a one-block pool
    (nothing is written; attention reads block 0 again and again) -> (activation bytes,
    graph pool bytes)."""
    d = model.device
    kv = new_pool(model.cfg, 1, block_size, d, model.dtype)
    N = max_num_batched_tokens
    L = min(N, max_model_len)
    lens = [L] * (N // L) + ([N % L] if N % L else [])
    c = model.cfg
    args, _ = warmup.prefill_inputs(lens, block_size, max_num_seqs, d, (c.num_attention_heads, c.num_key_value_heads))
    R = min(max_num_seqs, N)  # the most rows a step samples
    args = (*args[:8], torch.full((R,), N - 1, device=d, dtype=torch.int64), args[9])
    peaks = []
    steps = [(args, R)]
    if graphs:
        kb = context_bucket(max_model_len, max_model_len)
        steps.append((warmup.decode_inputs(max_num_seqs, kb, block_size, d), max_num_seqs))
    for a, rows in steps:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        before = torch.cuda.memory_allocated(d)
        out = paged_forward.sample_rows(model, paged_forward.hidden(model, kv, *a), warmup.sampling_inputs(rows, d))
        torch.cuda.synchronize(d)
        peaks.append(torch.cuda.max_memory_allocated(d) - before)
        del out
    return peaks[0], (peaks[1] if len(peaks) > 1 else 0)
