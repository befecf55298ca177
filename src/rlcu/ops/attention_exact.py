"""Exact mode's attention: one kernel for the trainer's packed sequences and the engine's paged
cache (chunked prefill and decode), so that a query row's keys are reduced in the same tiles
and the same order on both paths, whatever else is in the batch.

Program = (query tile, sequence, KV head); a tile holds BM rows = BMT query tokens x the G
query heads of one KV head (BM = max(16, G): decode has G live rows, as the default decode
kernel has). Every row walks the key tiles [0, BN), [BN, 2 BN), ... from position 0 up to the
tile that holds its own position, with the FlashAttention online softmax in base 2:
    s = q k^T scale log2(e),  m' = max(m, rowmax s),  l' = l 2^(m - m') + rowsum 2^(s - m'),
    acc' = acc 2^(m - m') + 2^(s - m') v,   o = acc / l,   lse = (m + log2 l) ln 2.
Keys past a row's position give it p = 0 and leave m, l and acc bit for bit unchanged (alpha
= 2^0 = 1), so the tiles its tile mates need beyond it change nothing; a row's result is a
function of its position and its own keys only. A program may hold SUB such sub-tiles of
consecutive tokens (training, prefill chunks) sharing each K/V tile's load; each runs a lone
sub-tile's instructions. Every tile goes through the same masked code
(no unmasked fast path below the diagonal): the float ops of a tile, and so what the compiler
fuses into FMAs, are the same whichever rows share it. No split-KV (the default decode kernel
splits a context by the batch's size): a long context with few sequences runs on fewer SMs.

Addressing: PAGED reads key p of sequence s at cache slot block_tables[s, p // BS] * BS +
p % BS; otherwise (training) at row cu_seqlens[s] + p of the packed K, V. Training also
writes lse [Hq, N] (natural log) for attention_bwd, which is unchanged.

The twin: scores, the softmax sum and P V are fixed halving trees over D and over the keys
(`tree_sum`), with keys past a row's position at p = 0: a tree padded with zeros keeps its
bits, so a decode row over L keys equals the training row whose sequence is longer.
"""

from __future__ import annotations

import itertools

import torch

from rlcu.ops._backend import HAS_TRITON, interpreting, use_triton
from rlcu.ops.exact import tree_sum

if HAS_TRITON:
    import triton
    import triton.language as tl

    from rlcu.ops.matmul_invariant import dot_invariant

_LOG2E = 1.4426950408889634
# BM rows a sub-tile, BN keys a tile: fixed, both paths run them. SUB_*: sub-tiles a program of
# the training kernel / of an engine prefill chunk (1, 2 or 4; decode has one): they share each
# key tile's load (K/V traffic / SUB) and change no bits (compiled for sm_90 at D = 128: the
# float instructions are SUB times a decode program's; 118 registers at SUB = 1, 218 at 2, 255
# and a 56-byte spill at 4; bench/exact.py times each)
# BM_TRAIN: the row tile of training and prefill programs (many rows each) at head_dim 128, BM
# the decode one's (one token a sequence): on the H200 at head_dim 128 the 16- and 32-row tiles
# at 4 warps give every row the same bits, 64 rows or 8 warps do not (another reduction
# layout; bench/results/exact_tiles.json); at head_dim 24 even 32 rows do not
CONFIG = {"BM": 16, "BM_TRAIN": 32, "BN": 64, "num_warps": 4, "num_stages": 2, "SUB_TRAIN": 2, "SUB_PREFILL": 2}
_INTERPRET_CONFIG = {"BM": 16, "BM_TRAIN": 16, "BN": 16, "num_warps": 4, "num_stages": 1, "SUB_TRAIN": 2,
                     "SUB_PREFILL": 4}
_REF_ELEMS = 1 << 22


if HAS_TRITON:

    @triton.jit
    def _kv_tile(K, V, bt_row, q_start, hk, stride_kn, stride_kh, stride_vn, stride_vh, n, last,
                 PAGED: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                 BN: tl.constexpr):
        # keys n .. n + BN - 1 (those past `last` load as zeros) -> (k, v [BN, BD], pos, pmask)
        d = tl.arange(0, BD)
        pos = n + tl.arange(0, BN)
        pmask = pos <= last
        if PAGED:  # [BN] int64 rows of K / V
            r = tl.load(bt_row + pos // BS, mask=pmask, other=0).to(tl.int64) * BS + pos % BS
        else:
            r = q_start + pos
        kvm = pmask[:, None] & (d < D)[None, :]
        k = tl.load(K + r[:, None] * stride_kn + hk * stride_kh + d[None, :], mask=kvm, other=0.0)
        v = tl.load(V + r[:, None] * stride_vn + hk * stride_vh + d[None, :], mask=kvm, other=0.0)
        return k, v, pos, pmask

    @triton.jit
    def _tile(acc, l, m, q, k, v, pos, pmask, pos_q, scale_log2, BM: tl.constexpr, BN: tl.constexpr,
              BY_SUM: tl.constexpr):
        # one key tile into one 16-row sub-tile's online softmax: the same instructions for every
        # sub-tile of every variant (the keys a row may not see are masked, never skipped)
        sc = dot_invariant(q, tl.trans(k), tl.zeros([BM, BN], tl.float32), False, BY_SUM)
        sc = tl.where(pmask[None, :] & (pos[None, :] <= pos_q[:, None]), sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = dot_invariant(p.to(v.dtype), v, acc * alpha[:, None], False, BY_SUM)
        return acc, l, m_new

    @triton.jit
    def _rows(Q, K, q_start, q_len, L, t0, hk, stride_qn, stride_qh, G: tl.constexpr,
              BM: tl.constexpr, BMT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        # sub-tile rows: BMT tokens from t0 x the G heads of KV head hk -> (q, t, h, rmask, pos_q)
        r = tl.arange(0, BM)
        t = t0 + r // G  # [BM] query token of each row
        h = hk * G + r % G  # [BM] its query head
        d = tl.arange(0, BD)
        rmask = (r < BMT * G) & (t < q_len)
        q = tl.load(Q + (q_start + t)[:, None] * stride_qn + h[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & (d < D)[None, :], other=0.0).to(K.dtype.element_ty)
        return q, t, h, rmask, L - q_len + t

    @triton.jit
    def _finish(acc, l, m, O, LSE, N_LSE, q_start, t, h, rmask, stride_on, stride_oh,
                WITH_LSE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
        d = tl.arange(0, BD)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        rows = q_start + t
        tl.store(O + rows[:, None] * stride_on + h[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])
        if WITH_LSE:
            tl.store(LSE + h * N_LSE + rows, (m + tl.log2(l)) * 0.6931471805599453, mask=rmask)

    @triton.jit(do_not_specialize=["stride_bt", "N_LSE"])
    def _attn_exact_kernel(Q, K, V, O, LSE, BLOCK_TABLES, CU_Q, SEQ_LENS, N_LSE,
                           stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                           stride_bt, stride_on, stride_oh, scale_log2,
                           PAGED: tl.constexpr, WITH_LSE: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                           BMT: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           BS: tl.constexpr, BN: tl.constexpr, BY_SUM: tl.constexpr):
        # SUB (1, 2 or 4) sub-tiles of BM rows share each key tile's load: a sub-tile's math is
        # the one a lone sub-tile runs, so SUB changes traffic, never bits
        tile = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1).to(tl.int64)
        hk = tl.program_id(2).to(tl.int64)
        q_start = tl.load(CU_Q + s).to(tl.int64)
        q_len = tl.load(CU_Q + s + 1).to(tl.int64) - q_start
        if PAGED:
            L = tl.load(SEQ_LENS + s).to(tl.int64)
        else:
            L = q_len
        t0 = tile * (BMT * SUB)
        if t0 >= q_len:
            return
        last = tl.minimum(L - q_len + t0 + SUB * BMT - 1, L - 1)  # the last key any row sees
        bt_row = BLOCK_TABLES + s * stride_bt
        q0, t_0, h0, rm0, pq0 = _rows(Q, K, q_start, q_len, L, t0, hk, stride_qn, stride_qh, G, BM, BMT, D, BD)
        m0 = tl.full([BM], float("-inf"), tl.float32)
        l0 = tl.zeros([BM], tl.float32)
        a0 = tl.zeros([BM, BD], tl.float32)
        if SUB >= 2:
            q1, t_1, h1, rm1, pq1 = _rows(Q, K, q_start, q_len, L, t0 + BMT, hk, stride_qn, stride_qh, G, BM,
                                          BMT, D, BD)
            m1, l1, a1 = m0, l0, a0
        if SUB >= 4:
            q2, t_2, h2, rm2, pq2 = _rows(Q, K, q_start, q_len, L, t0 + 2 * BMT, hk, stride_qn, stride_qh, G,
                                          BM, BMT, D, BD)
            q3, t_3, h3, rm3, pq3 = _rows(Q, K, q_start, q_len, L, t0 + 3 * BMT, hk, stride_qn, stride_qh, G,
                                          BM, BMT, D, BD)
            m2, l2, a2 = m0, l0, a0
            m3, l3, a3 = m0, l0, a0
        for n in range(0, last + 1, BN):
            k, v, pos, pm = _kv_tile(K, V, bt_row, q_start, hk, stride_kn, stride_kh, stride_vn, stride_vh, n,
                                     last, PAGED, D, BD, BS, BN)
            a0, l0, m0 = _tile(a0, l0, m0, q0, k, v, pos, pm, pq0, scale_log2, BM, BN, BY_SUM)
            if SUB >= 2:
                a1, l1, m1 = _tile(a1, l1, m1, q1, k, v, pos, pm, pq1, scale_log2, BM, BN, BY_SUM)
            if SUB >= 4:
                a2, l2, m2 = _tile(a2, l2, m2, q2, k, v, pos, pm, pq2, scale_log2, BM, BN, BY_SUM)
                a3, l3, m3 = _tile(a3, l3, m3, q3, k, v, pos, pm, pq3, scale_log2, BM, BN, BY_SUM)
        _finish(a0, l0, m0, O, LSE, N_LSE, q_start, t_0, h0, rm0, stride_on, stride_oh, WITH_LSE, D, BD)
        if SUB >= 2:
            _finish(a1, l1, m1, O, LSE, N_LSE, q_start, t_1, h1, rm1, stride_on, stride_oh, WITH_LSE, D, BD)
        if SUB >= 4:
            _finish(a2, l2, m2, O, LSE, N_LSE, q_start, t_2, h2, rm2, stride_on, stride_oh, WITH_LSE, D, BD)
            _finish(a3, l3, m3, O, LSE, N_LSE, q_start, t_3, h3, rm3, stride_on, stride_oh, WITH_LSE, D, BD)


def _tiles(G: int, many_rows: bool = False, D: int = 128):
    cfg = _INTERPRET_CONFIG if interpreting() else CONFIG
    # BM_TRAIN where the device check covers it (head_dim 128; at 24 it gave other bits:
    # bench/results/exact_variants_tiny.json), else the decode's tile everywhere
    BM = max(cfg["BM_TRAIN" if many_rows and D == 128 else "BM"], triton.next_power_of_2(G))
    return cfg, BM, BM // G


def _launch(q, k, v, o, lse, tables, cu_q, seq_lens, max_q, scale, paged, BS, sub):
    N, Hq, D = q.shape
    Hk = k.shape[-2]
    S = cu_q.numel() - 1
    G = Hq // Hk
    cfg, BM, BMT = _tiles(G, max_q > 1, D)
    BD = max(16, triton.next_power_of_2(D))
    if q.stride(2) != 1:
        q = q.contiguous()
    if sub not in (1, 2, 4):
        raise ValueError(f"attention_exact: CONFIG's SUB_TRAIN / SUB_PREFILL must be 1, 2 or 4, got {sub}")
    sub = sub if max_q > BMT else 1  # decode and short chunks: one sub-tile
    _attn_exact_kernel[(triton.cdiv(max(max_q, 1), BMT * sub), S, Hk)](
        q, k, v, o, lse if lse is not None else o, tables, cu_q, seq_lens, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        tables.stride(0), o.stride(0), o.stride(1), scale * _LOG2E, PAGED=paged, WITH_LSE=lse is not None,
        G=G, BM=BM, BMT=BMT, SUB=sub, D=D, BD=BD, BS=BS, BN=cfg["BN"], BY_SUM=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ------------------------------------------------------------------------------- the twin
def _attend_ref(q, k, v, pos_q, scale):
    """q: [R, Hq, D] at absolute positions pos_q [R]; k, v: [L, Hk, D] (keys 0 .. L-1 of the
    sequence) -> (o [R, Hq, D] fp32, lse [Hq, R]); fixed trees over D and the keys."""
    R, Hq, D = q.shape
    L, Hk = k.shape[0], k.shape[1]
    G = Hq // Hk
    kf = k.float().transpose(0, 1).repeat_interleave(G, 0)  # [Hq, L, D]
    vt = v.float().permute(1, 2, 0).repeat_interleave(G, 0)  # [Hq, D, L]
    o = torch.empty(R, Hq, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(Hq, R, device=q.device, dtype=torch.float32)
    step = max(1, _REF_ELEMS // max(Hq * L * D, 1))
    keys = torch.arange(L, device=q.device)
    for r0 in range(0, R, step):
        qs = q[r0:r0 + step].float().transpose(0, 1)  # [Hq, r, D]
        sc = tree_sum(qs[:, :, None, :] * kf[:, None, :, :]) * scale  # [Hq, r, L]
        sc = sc.masked_fill(keys[None, None, :] > pos_q[r0:r0 + step, None], float("-inf"))
        mx = sc.max(-1).values  # [Hq, r]
        p = torch.exp(sc - mx[..., None])
        den = tree_sum(p)
        acc = tree_sum(p[:, :, None, :] * vt[:, None, :, :])  # [Hq, r, D]
        o[r0:r0 + step] = (acc / den[..., None]).transpose(0, 1)
        lse[:, r0:r0 + step] = mx + torch.log(den)
    return o, lse


def attention_exact_varlen_ref(q, k, v, cu_seqlens, max_seqlen, scale):
    N = q.shape[0]
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], N, device=q.device, dtype=torch.float32)
    cu = cu_seqlens.tolist()
    for s, e in itertools.pairwise(cu):
        if e > s:
            pos = torch.arange(e - s, device=q.device)
            os_, ls = _attend_ref(q[s:e], k[s:e], v[s:e], pos, scale)
            o[s:e], lse[:, s:e] = os_.to(q.dtype), ls
    return o, lse


def attention_exact_paged_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    o = torch.zeros_like(q)
    BS = k_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        q0, q1 = cu[s], cu[s + 1]
        if q1 == q0 or L == 0:
            continue
        blocks = block_tables[s, : (L + BS - 1) // BS].long()
        k = k_cache[blocks].flatten(0, 1)[:L]
        v = v_cache[blocks].flatten(0, 1)[:L]
        pos = torch.arange(L - (q1 - q0), L, device=q.device)
        o[q0:q1] = _attend_ref(q[q0:q1], k, v, pos, scale)[0].to(q.dtype)
    return o


# ----------------------------------------------------------------------------- public ops
def attention_exact_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """Exact mode's attention_fwd: q [N, Hq, D], k, v [N, Hk, D], cu_seqlens [S+1] int32
    -> (o [N, Hq, D], lse [Hq, N] fp32), as attention.attention_fwd (rows past cu_seqlens[S]
    are zero)."""
    if not use_triton(q):
        return attention_exact_varlen_ref(q, k, v, cu_seqlens, max_seqlen, scale)
    q, k, v = _heads(q), _heads(k), _heads(v)
    N, Hq, D = q.shape
    o = torch.zeros(N, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.zeros(Hq, N, device=q.device, dtype=torch.float32)
    if N:
        cu = cu_seqlens.contiguous()
        _launch(q, k, v, o, lse, cu, cu, cu, max_seqlen, scale, False, 1, _tiles(1)[0]["SUB_TRAIN"])
    return o, lse


def attention_exact_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          max_seqlen_q: int, scale: float):
    """Exact mode's paged_attention (prefill chunks and decode in one kernel): q [N, Hq, D],
    caches [num_blocks, block_size, Hk, D], block_tables [S, W] int32, cu_seqlens_q [S+1] and
    seq_lens [S] int32 (context lengths including the new tokens) -> o [N, Hq, D]."""
    if not use_triton(q):
        return attention_exact_paged_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                         scale)
    N, Hq, D = q.shape
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    o = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    if N == 0 or seq_lens.shape[0] == 0:
        return o
    kc, vc = k_cache.view(-1, Hk, D), v_cache.view(-1, Hk, D)  # [slots, Hk, D]
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    _launch(q, kc, vc, o, None, tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
            max_seqlen_q, scale, True, BS, _tiles(1)[0]["SUB_PREFILL"])
    return o
