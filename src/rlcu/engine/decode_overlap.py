"""A pure decode step as two half-batches on two streams, their attentions in turn, so that
one half's attention (bound by the KV cache's bandwidth) runs beside the other half's GEMMs and
small kernels (bound by latency and the tensor cores).

A decode step runs its layers one after the other, and within a layer the attention waits for
the QKV projection and the projections wait for the attention: at 256 sequences the attention
reads the K/V of every context at the memory's speed while the tensor cores idle, then the
GEMMs run while the memory idles. Split the batch's rows (one token a sequence) in two halves
A and B: on stream A, half A's layers; on stream B, half B's. An event orders the attentions
A0, B0, A1, B1, ... (attention i of one half waits for the other half's last one), so the
attentions never compete with each other and, while one runs, the other half does the rest of
its layer (the output projection and the MLP of this layer, the norm, QKV projection and
qkv_prep of the next).

The halves are independent (a decode row reads only its own sequence's cache), so the result
is the rows of `paged_forward.hidden` (up to the GEMMs' rounding for M rows against M / 2: not
batch-invariant, as the default mode never is; exact mode does not take this path). In a
decode step cu_q is 0, 1, ..., S (one query a sequence), so a half of n rows passes cu_q[:n + 1].

The step graphs capture it as it runs (the events and the second stream become graph edges);
eagerly it runs the same way. Without CUDA (side is None) the halves run one after the other.
"""

from __future__ import annotations

import torch

from rlcu.engine.paged_forward import attention_inputs, attention_out, final
from rlcu.model.qwen3 import Qwen3
from rlcu.ops.embedding import embedding_fwd
from rlcu.ops.exact import is_exact
from rlcu.ops.paged_attention import paged_attention

MIN_ROWS = 64  # the fewest decode rows split in two (a graph bucket's batch size)


def split_rows(n: int) -> int:
    """Rows of the first half of n decode rows: n / 2 rounded up to a multiple of 8 (so that the
    graph buckets, multiples of 16, split evenly)."""
    return min(n, -(-n // 16) * 8)


def overlapped(n: int) -> bool:
    """Whether a decode step of n rows runs as two halves (see the module's docstring)."""
    return n >= MIN_ROWS and not is_exact()


def hidden_decode(model: Qwen3, kv: torch.Tensor, ids, pos, kv_slots, block_tables, cu_q, seq_lens, max_k: int,
                  side: torch.cuda.Stream | None, gate: bool = True) -> torch.Tensor:
    """paged_forward.hidden of a pure decode step (ids, pos, kv_slots: [S]; block_tables [S, W];
    cu_q [S + 1] = 0..S; seq_lens [S]) as two halves, half B on stream `side` (None: one after
    the other on this stream). gate: order the halves' attentions (the default; False lets the
    streams drift, for the benchmark) -> final-normed hidden states [S, hidden]."""
    c, w = model.cfg, model.w
    scale = c.head_dim**-0.5
    S = ids.shape[0]
    x = embedding_fwd(ids, w["embed"])
    h = split_rows(S)
    main = torch.cuda.current_stream(x.device) if side is not None else None
    if side is not None:
        side.wait_stream(main)
    halves = [(slice(0, h), main), (slice(h, S), side)]
    last = None  # the event of the last attention launched
    for i in range(c.num_hidden_layers):
        for rows, stream in halves:
            n = rows.stop - rows.start
            with torch.cuda.stream(stream):
                xr = x[rows]
                q = attention_inputs(model, kv, i, xr, pos[rows], kv_slots[rows])
                if gate and last is not None:
                    stream.wait_event(last)
                o = paged_attention(q, kv[0, i], kv[1, i], block_tables[rows], cu_q[:n + 1], seq_lens[rows], 1,
                                    max_k, scale)
                if stream is not None:
                    last = torch.cuda.Event()
                    last.record(stream)
                attention_out(model, i, xr, o)
    if side is not None:
        main.wait_stream(side)
    return final(model, x)
