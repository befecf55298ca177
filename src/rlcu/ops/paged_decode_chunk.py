"""The work-list decode kernel of paged attention (paged_attention.decode_plan's kernel "chunk"):
sequence s is cut into cdiv(L_s, CHUNK) chunks, unit (chunk, KV head) is CHUNK keys whatever the
lengths, and a fixed grid of per_sm programs an SM takes units pid, pid + P, ...; the list is
built in each program from seq_lens, so the grid depends on sizes only (CUDA graphs). A
sequence of one chunk writes its output; the others write partials (o_j, lse_j) that
_decode_chunk_reduce_kernel combines in chunk order. A unit's keys go through
paged_keys.attend_keys, the split kernel's loop. On the H200 this kernel beats the split one only
for few long contexts (bench/results/decode_attention.json), so it is not the default.
"""

from __future__ import annotations

from rlcu.ops._backend import tl, triton
from rlcu.ops.paged_keys import attend_keys, combine_chunks


@triton.jit(do_not_specialize=["stride_bt", "S", "CHUNK"])
def _decode_chunk_kernel(Q, KC, VC, BLOCK_TABLES, CU_Q, SEQ_LENS, O, O_PART, LSE_PART, CH_FIRST,
                         stride_qn, stride_qh, stride_cs, stride_ch, stride_bt, stride_on,
                         stride_oh, S, Hq, Hk, scale_log2, CHUNK,
                         G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         BS: tl.constexpr, BN: tl.constexpr, BSEQ: tl.constexpr):
    # The work list: sequence s has n_s = cdiv(L_s, CHUNK) chunks (0 for an empty query), unit
    # u = (chunk t of the batch, KV head) with the heads fastest, so the Hk programs of one chunk
    # read neighbouring bytes. Each program takes units pid, pid + P, ... (P programs resident at
    # once): every unit is CHUNK keys but the last of a sequence, whatever the lengths' spread.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    i = tl.arange(0, BSEQ)
    imask = i < S
    qlen = (tl.load(CU_Q + i + 1, mask=imask, other=0) - tl.load(CU_Q + i, mask=imask, other=0))
    lens = tl.load(SEQ_LENS + i, mask=imask, other=0)
    # an empty context (a graph's padding entry) takes one unit of no keys: its o is zeros
    nch = tl.where(qlen > 0, tl.maximum((lens + CHUNK - 1) // CHUNK, 1), 0)  # [BSEQ]
    cum = tl.cumsum(nch, 0)
    first = cum - nch  # the batch's index of each sequence's first chunk
    if pid == 0:
        tl.store(CH_FIRST + i, first, mask=imask)  # for the combine
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    gmask = g < G
    dmask = d < D
    omask = gmask[:, None] & dmask[None, :]
    for u in range(pid, tl.sum(nch, 0) * Hk, nprog):
        t = u // Hk
        hk = (u % Hk).to(tl.int64)
        sel = i == tl.sum((cum <= t).to(tl.int32), 0)  # one-hot: the sequence of chunk t
        s = tl.sum(tl.where(sel, i, 0), 0).to(tl.int64)
        c = t - tl.sum(tl.where(sel, first, 0), 0)
        n_s = tl.sum(tl.where(sel, nch, 0), 0)
        L = tl.sum(tl.where(sel, lens, 0), 0)
        q_start = tl.load(CU_Q + s).to(tl.int64)
        n0 = c * CHUNK
        n1 = tl.minimum(n0 + CHUNK, L)
        h = hk * G + g  # [BG] query heads of this KV head
        m, l, acc = attend_keys(Q, q_start, h, omask, stride_qn, stride_qh, KC, VC, BLOCK_TABLES,
                                s, stride_bt, hk, d, dmask, n0, n1, stride_cs, stride_ch,
                                scale_log2, BG=BG, BD=BD, BS=BS, BN=BN)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        if n_s == 1:  # the whole context in one chunk: no combine
            tl.store(O + q_start * stride_on + h[:, None] * stride_oh + d[None, :],
                     out.to(O.dtype.element_ty), mask=omask)
        else:
            row = t.to(tl.int64) * Hq + h  # [BG] rows of the [chunks, Hq] partials
            tl.store(O_PART + row[:, None] * D + d[None, :], out, mask=omask)
            tl.store(LSE_PART + row, m + tl.log2(l), mask=gmask)  # l >= 1: keys seen


@triton.jit(do_not_specialize=["CHUNK"])
def _decode_chunk_reduce_kernel(O_PART, LSE_PART, CH_FIRST, CU_Q, SEQ_LENS, O, stride_on,
                                stride_oh, Hq, CHUNK, D: tl.constexpr, BD: tl.constexpr,
                                BJ: tl.constexpr):
    # the n_s partials of (s, h) in chunk order (paged_keys.combine_chunks)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    q_start = tl.load(CU_Q + s).to(tl.int64)
    if tl.load(CU_Q + s + 1).to(tl.int64) == q_start:
        return
    n_s = (tl.load(SEQ_LENS + s) + CHUNK - 1) // CHUNK
    if n_s <= 1:  # written by the attention kernel
        return
    first = tl.load(CH_FIRST + s).to(tl.int64)
    d = tl.arange(0, BD)
    dmask = d < D
    out = combine_chunks(O_PART, LSE_PART, first, n_s, h, Hq, d, dmask, D, BD, BJ, "")
    tl.store(O + q_start * stride_on + h * stride_oh + d, out.to(O.dtype.element_ty), mask=dmask)
