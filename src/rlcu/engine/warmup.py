"""The engine's start: compile at construction what a first `generate` would compile, and
capture the decode graphs it could replay (`LLM(warmup=True)`, the default on CUDA), so that
the first call of a process runs as fast as the next one.

Left to the first generate, three kinds of one-time work land inside it:
- Triton compiles. A kernel compiles once per signature: its constexprs, each pointer's dtype
  and 16-byte alignment, and each int argument's specialisation (== 1, divisible by 16)
  unless the kernel lists it in `do_not_specialize`. On the engine's path every int that
  follows a step's sizes (token and row counts N and B, the block tables' width, the decode
  split count and length) is unspecialised, every step buffer starts 16 bytes aligned, and the
  constexprs depend on the model's shape only, so each kernel has one variant, except the
  decode attention: split or not (`SPLIT`), and its reduce per power of two of the split
  count (BSPLIT, 2 .. 64), and qkv_prep: a few rows or many (ops/qkv_prep.py `launch`; the
  warm-up's prefill steps take both). The prefill attention, norms, swiglu, embedding and both
  sampler kernels (the row kernel is the largest compile) are one variant each.
- CUDA-graph captures: one per (batch bucket, context bucket) of the pure decode steps, tens
  of ms each (a warm-up step, then the capture), and one per token bucket of the prefill and
  mixed steps (engine/prefill_graphs.py).
- first calls: cuBLAS's handle and workspace, the decode state's and the readback's pinned
  host buffers.

The warm-up runs the runner's own forward and sampler (`_hidden`, `_sample`) on dummy steps
that write nowhere in the KV pool (kv slot -1): a small prefill step that samples (the
prefill kernels and the sampler) and one past qkv_prep's few rows, then every decode graph of
`graph_plan` (each batch bucket at each context bucket, after merging the context buckets whose
steps launch the same kernels), largest batch first so that the smaller graphs reuse the capture pool's memory,
then the prefill graphs of every token bucket, largest first.
Without graphs (enforce_eager) the same decode steps run eagerly, which compiles their
kernels. Off CUDA nothing compiles; one prefill and one decode step run on the twins.

Compiled kernels persist on disk (Triton's cache: ~/.triton/cache, or $TRITON_CACHE_DIR), so
on a machine that ran the engine before, the warm-up loads them (ms each) rather than
compiling; graphs live in the process only.
"""

from __future__ import annotations

import time

import torch

from rlcu.ops.paged_attention import prefill_tiles
from rlcu.ops.qkv_prep import CONFIGS as QKV_PREP


# ---------------------------------------------------------------------------- dummy steps
def sampling_inputs(rows: int, device) -> tuple:
    """The sampler's per-row tensors, dtypes as the engine's steps pass them: temperature 1,
    top-k 50 and top-p 0.9 (one compiled kernel whatever the filters; they only run more of it)."""
    f = lambda v: torch.full((rows,), v, device=device, dtype=torch.float32)  # noqa: E731
    i64 = torch.zeros(rows, device=device, dtype=torch.int64)
    return (f(1.0), torch.full((rows,), 50, device=device, dtype=torch.int32), f(0.9), f(0.0), i64, i64.clone())


def prefill_inputs(lens: list[int], block_size: int, max_num_seqs: int, device, heads: tuple[int, int]) -> tuple:
    """`_hidden`'s arguments for a prefill step of sequences of `lens` new tokens from
    position 0, writing nowhere (kv slot -1; attention reads block 0 again and again), with
    the last token of each sequence sampled (at most max_num_seqs rows) and the attention's
    tile list for `heads` = (query heads, KV heads), as the engine's steps pass it -> (args, rows)."""
    N, L = sum(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device, dtype=torch.int32)
    pos = torch.cat([torch.arange(n, device=device, dtype=torch.int32) for n in lens])
    ids = torch.zeros(N, device=device, dtype=torch.int64)
    kv_slots = torch.full((N,), -1, device=device, dtype=torch.int64)
    tables = torch.zeros(len(lens), -(-L // block_size), device=device, dtype=torch.int32)
    rows = (cu[1:].long() - 1)[:max_num_seqs]
    seq_lens = torch.tensor(lens, device=device, dtype=torch.int32)
    tiles = tuple(torch.from_numpy(t).to(device) for t in prefill_tiles(lens, *heads))
    return (ids, pos, kv_slots, tables, cu, seq_lens, L, L, rows, tiles), rows.shape[0]


def decode_inputs(b: int, kb: int, block_size: int, device) -> tuple:
    """`_hidden`'s arguments for a pure decode step of b rows launched for contexts of kb
    keys (the split-KV grid follows kb), each row at context 1 writing nowhere (as the
    graphs' padding rows)."""
    ids = torch.zeros(b, device=device, dtype=torch.int64)
    pos = torch.zeros(b, device=device, dtype=torch.int32)
    kv_slots = torch.full((b,), -1, device=device, dtype=torch.int64)
    tables = torch.zeros(b, -(-kb // block_size), device=device, dtype=torch.int32)
    cu = torch.arange(b + 1, device=device, dtype=torch.int32)
    lens = torch.ones(b, device=device, dtype=torch.int32)
    return ids, pos, kv_slots, tables, cu, lens, 1, kb


# ---------------------------------------------------------------------------- the warm-up
@torch.no_grad()
def warm_up(runner) -> dict:
    """Compile and capture, on `runner` (a ModelRunner with its KV pool), what the engine's
    steps will use (see the module docstring) -> what it did: seconds, graphs captured,
    eager decode steps run, bytes the captures added to the device's reserved memory."""
    if runner.kv is None:
        raise RuntimeError("warm_up needs the KV pool (the engine is asleep): call wake() first")
    t0 = time.perf_counter()
    dev, bs, cuda = runner.device, runner.block_size, runner.device.type == "cuda"
    budget, c = runner.max_num_batched_tokens, runner.cfg
    n = min(budget, 2 * bs + 3)  # any lengths do: one variant a kernel, but for qkv_prep's two
    steps = [[n, 1] if n < budget else [n]]
    many = min(budget, QKV_PREP["decode"]["max_tokens"] + 1)
    if cuda and many > n:  # its bulk launch (off CUDA nothing compiles: no need)
        steps.append([many])
    for lens in steps:
        args, R = prefill_inputs(lens, bs, runner.max_num_seqs, dev, (c.num_attention_heads, c.num_key_value_heads))
        out = runner._sample(runner._hidden(*args), sampling_inputs(R, dev))
    for _ in range(2):  # both readback buffers (pinned host memory)
        runner.collect(runner._readback(out))
    if cuda:
        torch.cuda.synchronize(dev)
    reserved0 = torch.cuda.memory_reserved(dev) if cuda else 0
    captures0, eager = runner.num_captures, 0
    if runner.use_graphs:
        runner.capture_graphs(runner.max_model_len)
    else:  # the same decode steps eagerly (off CUDA, one: nothing compiles there)
        for b, kb in runner.graph_plan() if cuda else runner.graph_plan()[-1:]:
            runner._sample(runner._hidden(*decode_inputs(b, kb, bs, dev)), sampling_inputs(b, dev))
            eager += 1
    prefill_graphs = runner.capture_prefill_graphs()
    if cuda:
        torch.cuda.synchronize(dev)
    return dict(seconds=time.perf_counter() - t0, graphs=len(runner.graphs), prefill_graphs=prefill_graphs,
                captures=runner.num_captures - captures0, eager_decode_steps=eager,
                graph_memory_bytes=(torch.cuda.memory_reserved(dev) - reserved0) if cuda else 0)
