"""The CUDA graphs of the pure decode steps: their buckets, their capture and their replay.

Pure decode steps (one token per sequence) of up to `max_num_seqs` sequences replay one graph
of the whole step (embedding to the sampled tokens and their logprobs, the LM head and the
sampler included) captured for the next batch-size bucket (1, 2, 4, 8, then multiples of 16)
and context bucket (1k, 4k, 16k, ..., max_model_len: the decode kernel's split-KV grid is
sized by the longest context; a batch wide enough to run unsplit, or any batch under the list
kernel, ops/paged_decode_list.py, has one graph for every context), all at the engine's start
(engine/warmup.py), else or after a wake that dropped them on first use. Padding rows write
nowhere (kv slot -1), attend to one key and sample at temperature 1 (their tokens are never
read).

A graph holds the addresses it was captured on: the step's fields (the decode state's device
buffers, engine/decode_state.py, and a block-table buffer of its own), the weights (a
replaced `model.flat`, or the model's exact mode switched, drops every graph: `follow`) and the KV pool
(graphs kept through a release stay only if the new pool sits at the old address: `keep`,
`rebind`). `GraphSet` holds those rules, a private memory pool, and the capture (on one stream
a device, `capture_stream`) for both kinds of step graphs: these and the prefill graphs
(engine/prefill_graphs.py).

The step itself is the runner's: `capture`, `capture_all` and `replay` take it as
`step(args, samp) -> (tokens, logprobs)`, with args the forward's (engine/paged_forward.py,
`hidden`) and samp the sampler's per-row tensors.
"""

from __future__ import annotations

import math

import torch

from rlcu.engine.decode_state import DecodeState
from rlcu.ops.paged_attention import decode_plan, sm_count

CONTEXT_BUCKET0 = 1024  # the smallest context bucket; then x4 up to max_model_len


def graph_buckets(max_bs: int) -> list[int]:
    """The decode graphs' batch sizes: 1, 2, 4, 8, multiples of 16, and max_bs."""
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 16, 16)] if b < max_bs} | {max_bs})


def context_bucket(max_k: int, max_model_len: int) -> int:
    """The smallest context bucket (1k, 4k, 16k, ..., max_model_len) holding max_k keys."""
    kb = CONTEXT_BUCKET0
    while kb < max_k:
        kb *= 4
    return min(kb, max_model_len)


def context_buckets(max_context: int, max_model_len: int) -> list[int]:
    """The context buckets up to the one holding max_context."""
    top = context_bucket(min(max_context, max_model_len), max_model_len)
    out, kb = [], CONTEXT_BUCKET0
    while kb < top:
        out.append(kb)
        kb *= 4
    return out + [top]


def graph_plan(max_num_seqs: int, max_context: int, max_model_len: int, key) -> list[tuple[int, int]]:
    """The distinct graph keys `key(batch, context)` of every batch bucket at every context
    bucket up to max_context, largest batch first (then smaller contexts first)."""
    keys = {key(b, kb) for kb in context_buckets(max_context, max_model_len) for b in graph_buckets(max_num_seqs)}
    return sorted(keys, key=lambda k: (-k[0], k[1]))


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every engine graph of this process on `device` is captured on. torch's
    default capture stream is made once per process, on the device current at the first
    capture, and capturing on it would switch a later capture to that device; and each stream
    a GEMM runs on gets a cuBLAS workspace of its own (32 MiB on the H200), so the decode and
    prefill graphs share one."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[idx] = torch.cuda.Stream(torch.device("cuda", idx))
    return _CAPTURE_STREAMS[idx]


class GraphSet:
    """What a set of CUDA graphs of engine steps holds, and when they are dropped: the weights'
    address and the exact mode they were captured in (`follow`), the KV pool's address
    (`keep`, `rebind`), their private memory pool (`_record`). The decode
    graphs (below) and the prefill graphs (engine/prefill_graphs.py) are one each, with pools
    of their own, so that either can be dropped and give its memory back."""

    def __init__(self, device: torch.device, weights_ptr: int, exact: bool = False):
        self.device = device
        self.graphs: dict = {}  # key -> (replay, outputs)
        self._static: dict[str, torch.Tensor] | None = None  # the buffers the graphs read
        self._pool = None
        self.weights_ptr = weights_ptr  # model.flat's address when the graphs were captured
        self.exact = exact  # the model's exact mode when the graphs were captured
        self.kv_ptr = None  # the pool's addresses (ModelRunner._pool_key) when graphs were kept through a release
        self.wakes = {"kept": 0, "recaptured": 0}  # wakes after a release that kept the graphs
        self.num_captures = 0  # CUDA graphs captured, ever

    def drop(self) -> None:
        self.graphs, self._static, self._pool = {}, None, None

    def follow(self, weights_ptr: int, exact: bool) -> None:
        """Drop the graphs if the weights moved or the model's exact mode was switched (they
        hold other kernels' launches or other addresses)."""
        if weights_ptr != self.weights_ptr or self.exact != exact:
            self.drop()
            self.weights_ptr = weights_ptr
            self.exact = exact

    def keep(self, kv_ptr) -> None:
        """The KV pool at kv_ptr (its tensors' addresses) goes away and the graphs stay (see `rebind`)."""
        self.kv_ptr = kv_ptr

    def rebind(self, kv_ptr) -> None:
        """A new KV pool at kv_ptr (its tensors' addresses): graphs kept through a release stay if it sits where the old
        one was, else they are dropped (and captured again)."""
        if self.graphs:
            kept = kv_ptr == self.kv_ptr
            self.wakes["kept" if kept else "recaptured"] += 1
            if not kept:
                self.drop()

    def _record(self, fn) -> tuple:
        """Capture fn() -> (replay function, its outputs), on the capture stream of this
        object's device (`capture_stream`)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=capture_stream(self.device)):
            out = fn()
        self.num_captures += 1
        torch.cuda.synchronize(self.device)
        return g.replay, out


class DecodeGraphs(GraphSet):
    def __init__(self, *, max_num_seqs: int, max_model_len: int, block_size: int, num_kv_heads: int,
                 device: torch.device, weights_ptr: int, exact: bool = False):
        super().__init__(device, weights_ptr, exact)
        self.max_num_seqs, self.max_model_len, self.block_size = max_num_seqs, max_model_len, block_size
        self.num_kv_heads = num_kv_heads

    # ------------------------------------------------------------------ buckets
    def batch_bucket(self, S: int) -> int:
        """The graphs' batch size for S rows (rows S.. are padding rows)."""
        return next(b for b in graph_buckets(self.max_num_seqs) if b >= S)

    def key(self, S: int, max_k: int) -> tuple[int, int]:
        """(batch bucket, context bucket): the decode kernel's split count follows max_seqlen_k,
        so graphs are kept per context bucket (1k, 4k, 16k, ... up to max_model_len). A batch
        wide enough to run unsplit at its bucket and at max_model_len takes the max_model_len
        bucket: an unsplit step is the same kernel whatever the bucket (its one split covers
        any context), so one graph serves every context. The mode is the graphs' (`follow`)."""
        b = self.batch_bucket(S)
        kb = context_bucket(max_k, self.max_model_len)
        if (kb < self.max_model_len and not self.exact and self._any_context(b, kb)
                and self._any_context(b, self.max_model_len)):
            kb = self.max_model_len
        return b, kb

    def _any_context(self, b: int, kb: int) -> bool:
        # the split kernel with one split is the same launch at any bucket, and so is the list
        # kernel (its grid and partials follow the batch, never the context)
        plan = decode_plan(b, self.num_kv_heads, kb, sm_count(self.device))
        return plan["kernel"] == "list" or (plan["kernel"] == "split" and plan["splits"] == 1)

    def plan(self, max_context: int | None = None) -> list[tuple[int, int]]:
        """The graph keys of every batch bucket at every context bucket up to max_context
        (default: max_model_len), in capture order (graph_plan)."""
        mc = self.max_model_len if max_context is None else max_context
        return graph_plan(self.max_num_seqs, mc, self.max_model_len, self.key)

    # ------------------------------------------------------------------ capture, replay
    @torch.no_grad()
    def capture(self, b: int, kb: int, dec: DecodeState, step) -> None:
        """Capture the graph of key (b, kb) on dec's device buffers."""
        d = self.device
        if self._static is None:
            max_bs, W = self.max_num_seqs, math.ceil(self.max_model_len / self.block_size)
            v = dec.dev  # ids, pos, kv slots, lens: filled by the decode step's one copy
            self._static = dict(
                ids=v["ids"], pos=v["pos"], kv_slots=v["kv_slots"], lens=v["lens"],
                tables=torch.zeros(max_bs, W, device=d, dtype=torch.int32),
                cu=torch.arange(max_bs + 1, device=d, dtype=torch.int32),
            )
        st = self._static
        args = (st["ids"][:b], st["pos"][:b], st["kv_slots"][:b], st["tables"][:b], st["cu"][:b + 1], st["lens"][:b],
                1, kb)
        saved = {k: v.clone() for k, v in st.items() if k != "tables"}
        st["kv_slots"].fill_(-1)  # the warm-up and capture runs must write nowhere
        st["lens"].fill_(1)
        samp = dec.sampling(b)

        def run():
            return step(args, samp)

        run()  # compiles the kernels outside the capture
        self.graphs[(b, kb)] = self._record(run)
        for k, v in saved.items():
            st[k].copy_(v)

    def capture_all(self, max_context: int, dec: DecodeState, step) -> None:
        """Capture the graphs of `plan(max_context)` not captured yet."""
        for key in self.plan(max_context):
            if key not in self.graphs:
                self.capture(*key, dec, step)

    def replay(self, S: int, max_k: int, dec: DecodeState, step):
        """Run a decode step of S rows, their fields loaded into dec for batch_bucket(S) rows,
        by its graph (captured now if missing) -> (tokens [S], logprobs [S])."""
        key = self.key(S, max_k)
        if key not in self.graphs:
            self.capture(*key, dec, step)
        b = key[0]
        # the entries the kernel may read: those of the step's context bucket (a graph merged
        # into the max_model_len bucket reads no further, see key)
        W = math.ceil(context_bucket(max_k, self.max_model_len) / self.block_size)
        self._static["tables"][:b, :W] = dec.block_tables(b, W)
        replay, (tokens, logprobs) = self.graphs[key]
        replay()
        return tokens[:S], logprobs[:S]
