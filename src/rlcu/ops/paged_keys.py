"""The inner loop of the paged-attention decode kernels, written once: the G query heads of one KV
head (padded to BG rows) attend to keys n0 .. n1 - 1 of one sequence, BN keys a step, with an
online softmax; and that softmax's update for one tile of scores (`softmax_tile`), which the
prefill kernel's two loops (paged_attention.py) take too.

Each BN-key tile: the block-table entries of its positions (key p is at cache slot
BLOCK_TABLES[s, p // BS] * BS + p % BS), the gather of K and V from the paged cache, the scores
q K^T * scale_log2 (log2 domain), keys at or past n1 masked to -inf, then
    m' = max(m, rowmax(sc)),  l' = l 2^(m - m') + rowsum(2^(sc - m')),
    acc' = acc 2^(m - m') + 2^(sc - m') V.
The decode kernels (the split kernel of paged_attention.py, the work-list kernel of
paged_decode_list.py) call it; each normalises and stores the result its own way. Triton
inlines a jit function into its caller, so this is the code each kernel had inline (the
kernels' sm_90 PTX is the same as with the lines written out).
"""

from __future__ import annotations

from rlcu.ops._backend import tl, triton


@triton.jit
def softmax_tile(m, l, acc, sc, VC, kv_off, vmask):
    """One tile of the online softmax: scores sc [rows, BN] (log2 domain, -inf where masked)
    and the tile's V rows, gathered at VC + kv_off where vmask -> the updated (m, l, acc):
        m' = max(m, rowmax(sc)),  l' = l 2^(m - m') + rowsum(2^(sc - m')),
        acc' = acc 2^(m - m') + 2^(sc - m') V.
    V is loaded after the scores' exponentials, where each kernel had its load."""
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(VC + kv_off, mask=vmask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def combine_chunks(O_PART, LSE_PART, first, n_s, h, Hq, d, dmask, D: tl.constexpr, BD: tl.constexpr,
                   BJ: tl.constexpr):
    """Query head h's n_s normalised partials (rows (first + j) Hq + h of O_PART [., D] and
    LSE_PART, lse_j = m_j + log2 l_j) combined in chunk order, BJ at a time (their loads in
    flight together), online over the blocks -> o [BD] fp32:
        o = sum_j 2^(lse_j - M) o_j / sum_j 2^(lse_j - M).
    The loads go through L2 (".cg"): other programs of the same launch wrote the partials."""
    jj = tl.arange(0, BJ)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    for j0 in range(0, n_s, BJ):
        jm = j0 + jj < n_s
        row = (first + j0 + jj) * Hq + h  # [BJ]
        lse = tl.load(LSE_PART + row, mask=jm, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(O_PART + row[:, None] * D + d[None, :], mask=jm[:, None] & dmask[None, :], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: j0 < n_s
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # [BJ], 0 where masked
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    return acc / den


@triton.jit
def group_rows(hk, G, BG: tl.constexpr, D, BD: tl.constexpr):
    """The rows of KV head hk's G query heads (padded to BG) and the head dim (padded to BD):
    (g, d, gmask, dmask, h = hk G + g the query heads, omask [BG, BD])."""
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    gmask = g < G
    dmask = d < D
    return g, d, gmask, dmask, hk * G + g, gmask[:, None] & dmask[None, :]


@triton.jit
def attend_keys(Q, q_start, h, qmask, stride_qn, stride_qh, KC, VC, BLOCK_TABLES, s, stride_bt, hk, d,
                dmask, n0, n1, stride_cs, stride_ch, scale_log2, BG: tl.constexpr, BD: tl.constexpr,
                BS: tl.constexpr, BN: tl.constexpr):
    """The query heads h ([BG], rows where qmask [BG, BD] is False read as zeros) of query row
    q_start of Q (strides stride_qn, stride_qh) over keys n0 .. n1 - 1 of KV head hk of
    sequence s -> (m, l, acc): [BG] fp32 running max and sum (log2 domain), [BG, BD] fp32
    unnormalised output (o = acc / l where l > 0). KC, VC: the caches as [slots, Hk, D] (slot
    stride stride_cs, head stride stride_ch); row s of BLOCK_TABLES (row stride stride_bt): the
    sequence's blocks; d, dmask: arange(BD) and d < D."""
    q = tl.load(Q + q_start * stride_qn + h[:, None] * stride_qh + d[None, :], mask=qmask,
                other=0.0).to(KC.dtype.element_ty)
    m = tl.full([BG], float("-inf"), tl.float32)
    l = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for n in range(n0, n1, BN):
        pos = n + tl.arange(0, BN)
        pmask = pos < n1
        blk = tl.load(BLOCK_TABLES + s * stride_bt + pos // BS, mask=pmask, other=0).to(tl.int64)
        kv_off = (blk * BS + pos % BS)[:, None] * stride_cs + hk * stride_ch + d[None, :]
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(KC + kv_off, mask=kvmask, other=0.0)  # [BN, BD]
        sc = tl.dot(q, tl.trans(k)) * scale_log2  # [BG, BN]
        sc = tl.where(pmask[None, :], sc, float("-inf"))
        m, l, acc = softmax_tile(m, l, acc, sc, VC, kv_off, kvmask)
    return m, l, acc
