"""Token sampling from logits: temperature, min-p, top-k, top-p; seeded and reproducible per row.

With z = logits / T (IEEE division, as torch; T = 1 for greedy rows, T = 0) and p = softmax(z),
the kept set is (vLLM's order; every set closed under ties, i.e. a threshold on z):
    min-p:  p_i >= min_p * max p             <=>  z_i >= max z + log(min_p)
    top-k:  #{j : z_j > z_i} < k             (z_i at least the k-th largest value)
    top-p:  within A = min-p & top-k,  sum_{j in A, z_j > z_i} p_j < top_p * sum_{j in A} p_j
            (the smallest upper set of A whose renormalised mass reaches top_p; never empty)
and the token is drawn by the exponential race (Gumbel-max) over the kept set:
    token = argmax_{i kept} z_i + g_i,  g_i = -log(-log u_i)  (= argmax p_i / E_i, E_i = -log u_i)
The uniforms come from a counter-based hash, u_i = f(seed, offset, i) (lowbias32 rounds, see
`rlcu.ops._hash`), so a row's draw depends on (its logits, seed, offset) alone, never on the
batch it sits in, and the twin (int64 torch ops) and the kernels (uint32) draw the same token.
(On the GPU the outer log of g is lg2.approx, ~1e-6 off: only a near-tie can differ.)
logprobs = log_softmax(z)[token] on the UNFILTERED distribution, as the trainer recomputes it.

Kernels (two launches). Every row is cut into pass-1 chunks (CHUNK tokens) and tiles (BT); the
cut depends on V only, so a row's sums never change with the batch. Pass 1 (program = row x
chunk) reads the logits once and keeps per chunk the online max / sum-exp, the argmax and the
race winner over all tokens, and per tile the largest key (below). `_row_kernel` (program =
row) combines the chunks into lse, the greedy token, the unfiltered winner and its logprob:
the whole job for temperature-only rows, the usual case in RL (one read of the logits).

Rows with filters continue in `_row_kernel`. Each kept set above is {i : key(z_i) > lo} for
the order-preserving int32 key of the float z, and "token i fails" is monotone in key(z_i),
so lo (the largest failing key) is found by a bracket search instead of a sort (no [B, V]
buffer, no host sync: the sampler can be captured in a CUDA graph). A search pass evaluates 16
pivot keys at once (the number of tokens above each, or their mass exp(z - m), and the
smallest key above each), shrinking the bracket 15-fold (<= 9 passes per filter for any
32-bit range); the lowest pivot of the next pass is the smallest token key above lo, so the
search stops as soon as the threshold token is isolated. A pass reads only the tiles whose
largest key is above its lowest pivot, eight tiles ahead of the one it evaluates, and pass 1's
tile maxima also seed the brackets: the k-th largest tile maximum bounds the top-k threshold
from below (k tokens are at least that large), and so do the tile maxima sorted by value whose
masses alone reach top_p * sum exp(z - m) (x 1.0001) for top-p. With top-k 50 a pass reads
~50 of a row's 594 tiles. Then the unfiltered winner stands if it is kept (a race over a
subset is won by the overall winner whenever it is in the subset), else the program races
over the kept tiles.

Passes a row needs (counted in the interpreter, V = 151936): top-k 50 + top-p 0.9 on the
benchmark's randn * 3 / 0.7 logits 3-5 (bf16) and 5-6 (fp32); top-p 0.95 over ~2000 strong
tokens 4-5; top-p 0.95 on flat randn fp32 6-8; min-p alone 0.

Why two launches (bench/kernel_suites/engine_ops.py, bench/results/kernels.json). One program
a row that reads the whole row every pass, tile after dependent tile, with each token's z /
key / exp computed 16 times over, was an order of magnitude slower with filters; a launch per
pass across the row made the filtered rows fast but paid its launches on the temperature-only
rows, the usual case. Here pass 1 (compute-bound: the noise hash) is spread over the whole
row, and a row's filter passes read only its candidate tiles (~50 of 594 with top-k 50), so
one program a row for them costs little beside pass 1.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, interpreting, libdevice, tl, triton
from rlcu.ops._hash import M32 as _M32
from rlcu.ops._hash import hash32 as _hash32
from rlcu.ops._hash import hash32_ref as _hash32_ref

_NP = 16  # pivots a search pass evaluates
# pass 1: BV a vector, CHUNK tokens a program (constants: sums must not depend on B); row
# (one program a row: the search and the race): BT tokens a tile (the unit of skipping),
# CHUNK tokens a chunk of tiles (bench/kernel_suites/engine_ops.py --sweep times others)
CONFIGS = {
    "pass1": dict(BV=1024, CHUNK=8192, num_warps=4),
    # 128 registers: two rows an SM (ptxas takes 176 unbounded: one; 8 bytes spill at 128)
    "row": dict(BT=256, CHUNK=32768, num_warps=8, maxnreg=128),
}
_PASSES = 9  # passes of 15 new pivots that pin any 32-bit key (2^32 -> 1), per filter


@triton.jit
def _row_key(SEEDS, OFFSETS, b):
    s = tl.load(SEEDS + b).to(tl.int64)
    o = tl.load(OFFSETS + b).to(tl.int64)
    k = _hash32((s & 0xFFFFFFFF).to(tl.uint32) ^ 0x243F6A88)
    k = _hash32(k ^ ((s >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _hash32(k ^ (o & 0xFFFFFFFF).to(tl.uint32))
    return _hash32(k ^ ((o >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _gumbel(key, idx, FAST: tl.constexpr):
    r = _hash32(_hash32(idx.to(tl.uint32) ^ key) + key)
    u = ((r >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # (2 r' + 1) / 2^24
    e = -tl.log(u)  # accurate: the winners have u near 1, where an approximate log is not
    if FAST:  # e in [6e-8, 17]: lg2.approx is good to ~1e-7 absolute in -log(e)
        return -libdevice.fast_logf(e)
    return -tl.log(e)


@triton.jit
def _okey(z):
    # float32 -> int32 with a < b <=> key(a) < key(b); -0.0 and 0.0 share key 0
    b = z.to(tl.int32, bitcast=True)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(b == -2147483648, 0, k)


@triton.jit
def _zkey(k):
    # the inverse of _okey (key 0 -> +0.0)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["B"])
def _pass1_kernel(LOGITS, TEMP, SEEDS, OFFSETS, PF, PI, TMAX, stride_b, B, V, NC, NT,
                  BV: tl.constexpr, CHUNK: tl.constexpr, BT: tl.constexpr, FAST: tl.constexpr):
    # per (row, chunk): max m, sum exp(z - m), min z, argmax, race winner (score, index);
    # per tile of BT tokens: the largest key (int32 min for a tile past V)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    T = tl.load(TEMP + b)
    race = T > 0
    T = tl.where(race, T, 1.0)
    key = _row_key(SEEDS, OFFSETS, b)
    mv = tl.full([BV], float("-inf"), tl.float32)
    sv = tl.zeros([BV], tl.float32)
    zminv = tl.full([BV], float("inf"), tl.float32)
    av = tl.full([BV], float("-inf"), tl.float32)
    ai = tl.zeros([BV], tl.int32)
    bv = tl.full([BV], float("-inf"), tl.float32)
    bi = tl.zeros([BV], tl.int32)
    for i in range(0, CHUNK, BV):
        idx = c * CHUNK + i + tl.arange(0, BV)
        mask = idx < V
        z = tl.load(LOGITS + b * stride_b + idx, mask=mask, other=float("-inf"))
        z = tl.math.div_rn(z.to(tl.float32), T)
        t = (c * CHUNK + i) // BT + tl.arange(0, BV // BT)  # [BV // BT] tiles
        tmax = _okey(tl.max(tl.reshape(z, [BV // BT, BT]), 1))
        tl.store(TMAX + b * NT + t, tl.where(t * BT < V, tmax, -2147483648))
        m_new = tl.maximum(mv, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        sv = sv * tl.exp(mv - m_safe) + tl.exp(z - m_safe)
        mv = m_new
        zminv = tl.where(mask, tl.minimum(zminv, z), zminv)
        upd = z > av  # strict: each lane keeps its first (smallest) index on ties
        ai = tl.where(upd, idx.to(tl.int32), ai)
        av = tl.where(upd, z, av)
        if race:
            sc = tl.where(mask, z + _gumbel(key, idx, FAST), float("-inf"))
            upd = sc > bv
            bi = tl.where(upd, idx.to(tl.int32), bi)
            bv = tl.where(upd, sc, bv)
    m = tl.max(mv, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(sv * tl.exp(mv - m_safe), 0)
    a = tl.min(tl.where(av == m, ai, 2147483647), 0)
    best = tl.max(bv, 0)
    w = tl.min(tl.where(bv == best, bi, 2147483647), 0)
    row = b * NC + c
    tl.store(PF + row, m)
    tl.store(PF + B * NC + row, s)
    tl.store(PF + 2 * B * NC + row, tl.min(zminv, 0))
    tl.store(PF + 3 * B * NC + row, best)
    tl.store(PI + row, a)
    tl.store(PI + B * NC + row, w)


@triton.jit
def _pick(j, sel, x):
    return tl.sum(tl.where(j == sel, x, 0), 0)


@triton.jit
def _pivots(j, base, hi, NP: tl.constexpr):
    # [NP] int64: base, then NP - 1 keys spread over [base + 1, hi], the first one base + 1
    return tl.where(j == 0, base, base + 1 + (hi - base - 1) * tl.maximum(j - 1, 0) // (NP - 1))


@triton.jit
def _narrow(j, piv, fail, mk, base, hi, NP: tl.constexpr):
    # fail is monotone over the pivots (true below the threshold), and true at lane 0 = base
    nf = tl.sum((fail | (j == 0)).to(tl.int32), 0)
    lo = _pick(j, nf - 1, tl.where(j == 0, base, piv))
    mk_lo = _pick(j, nf - 1, mk).to(tl.int64)  # the smallest token key above lo
    if nf < NP:
        hi = _pick(j, nf, piv)
    return lo, mk_lo, hi, (mk_lo >= hi) | (hi - lo <= 1)


@triton.jit
def _tiles(TMAX, b, c, NT, above, TPC: tl.constexpr):
    # the tiles of chunk c whose largest key is above `above`: (count, rank of each or -1, t)
    t = tl.arange(0, TPC)
    act = tl.load(TMAX + b * NT + c * TPC + t, mask=c * TPC + t < NT, other=-2147483648) > above
    return tl.sum(act.to(tl.int32), 0), tl.where(act, tl.cumsum(act.to(tl.int32), 0) - 1, -1), t


@triton.jit
def _tile_ld(LOGITS, stride_b, b, c, rank, t, r, n, V, BT: tl.constexpr, TPC: tl.constexpr):
    # the logits of the r-th listed tile of chunk c (nothing read when r >= n): (first index, x)
    i0 = (c * TPC + tl.sum(tl.where(rank == r, t, 0), 0)).to(tl.int32) * BT
    idx = i0 + tl.arange(0, BT)
    return i0, tl.load(LOGITS + b * stride_b + idx, mask=(idx < V) & (r < n), other=float("-inf"))


@triton.jit
def _row_pass(LOGITS, TMAX, stride_b, b, V, NT, NS, T, m, piv, is_p, BT: tl.constexpr,
              TPC: tl.constexpr, NP: tl.constexpr):
    # over the row, for each pivot p: the weight above p (1 a token, or exp(z - m) when is_p;
    # counts stay exact in fp32) and the smallest key above p. Only the tiles whose largest
    # key is above the lowest pivot can add anything, so only those are read, chunk by chunk,
    # eight tiles ahead of the one being evaluated (one token a thread: the loads in flight
    # are what keeps a pass over a dense row from waiting on memory). [NP, BT]: the pivots
    # are the slow axis, so each thread holds all of them for its token and computes its z,
    # key and weight once (the first version's [BT, NP] replicated that work 16 times).
    acc = tl.zeros([NP, BT], tl.float32)
    mk = tl.full([NP, BT], 2147483647, tl.int32)
    p0 = tl.min(piv, 0)
    for c in range(NS):
        n, rank, t = _tiles(TMAX, b, c, NT, p0, TPC)
        i0, x0 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 0, n, V, BT, TPC)
        i1, x1 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 1, n, V, BT, TPC)
        i2, x2 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 2, n, V, BT, TPC)
        i3, x3 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 3, n, V, BT, TPC)
        i4, x4 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 4, n, V, BT, TPC)
        i5, x5 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 5, n, V, BT, TPC)
        i6, x6 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 6, n, V, BT, TPC)
        i7, x7 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 7, n, V, BT, TPC)
        for r in range(n):
            idx = i0 + tl.arange(0, BT)
            z = tl.math.div_rn(x0.to(tl.float32), T)
            i0, x0, i1, x1, i2, x2, i3, x3 = i1, x1, i2, x2, i3, x3, i4, x4
            i4, x4, i5, x5, i6, x6 = i5, x5, i6, x6, i7, x7
            i7, x7 = _tile_ld(LOGITS, stride_b, b, c, rank, t, r + 8, n, V, BT, TPC)
            key = tl.where(idx < V, _okey(z), -2147483648)[None, :]  # [1, BT]
            wgt = tl.where(is_p, tl.exp(z - m), 1.0)[None, :]
            gt = key > piv[:, None]  # [NP, BT]
            acc += tl.where(gt, wgt, 0.0)
            mk = tl.minimum(mk, tl.where(gt, key, 2147483647))
    return tl.sum(acc, 1), tl.min(mk, 1)


@triton.jit
def _chunk_race(LOGITS, TMAX, stride_b, b, c, V, NT, T, lo, key, BT: tl.constexpr,
                TPC: tl.constexpr, FAST: tl.constexpr):
    # the race over the kept tokens (key > lo) of chunk c: (best score, its smallest index)
    n, rank, t = _tiles(TMAX, b, c, NT, lo, TPC)
    bv = tl.full([BT], float("-inf"), tl.float32)
    bi = tl.zeros([BT], tl.int32)
    i0, x0 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 0, n, V, BT, TPC)
    i1, x1 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 1, n, V, BT, TPC)
    i2, x2 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 2, n, V, BT, TPC)
    i3, x3 = _tile_ld(LOGITS, stride_b, b, c, rank, t, 3, n, V, BT, TPC)
    for r in range(n):  # four tiles in flight
        idx = i0 + tl.arange(0, BT)
        z = tl.math.div_rn(x0.to(tl.float32), T)
        i0, x0, i1, x1, i2, x2 = i1, x1, i2, x2, i3, x3
        i3, x3 = _tile_ld(LOGITS, stride_b, b, c, rank, t, r + 4, n, V, BT, TPC)
        kept = (idx < V) & (_okey(z).to(tl.int64) > lo)
        sc = tl.where(kept, z + _gumbel(key, idx, FAST), float("-inf"))
        upd = sc > bv
        bi = tl.where(upd, idx.to(tl.int32), bi)
        bv = tl.where(upd, sc, bv)
    best = tl.max(bv, 0)
    return best, tl.min(tl.where(bv == best, bi, 2147483647), 0)


@triton.jit
def _settle(stage, lo, hi, mk_lo, done, first, lo1, lo_pb, top_p, m, V):
    # a finished top-k search (stage 1) starts the top-p search (stage 2) within its kept
    # set, or ends the row (stage 0); a finished top-p search ends it
    hi0 = _okey(m).to(tl.int64)
    # tokens with exp(z - m) <= (1 - top_p) / V fail, as mass(A) >= 1 (halved: margin)
    lo_p = tl.maximum(tl.maximum(lo, _okey(m + tl.log(0.5 * (1.0 - top_p) / V)).to(tl.int64) - 1),
                      lo_pb)
    to_p = (stage == 1) & done & (top_p < 1.0)
    lo1 = tl.where(to_p, lo, lo1)
    lo = tl.where(to_p, lo_p, lo)
    mk_lo = tl.where(to_p, lo_p + 1, mk_lo)
    hi = tl.where(to_p, hi0, hi)
    first = tl.where(to_p, 1, first)
    done = tl.where(to_p, hi0 - lo_p <= 1, done)
    stage = tl.where(to_p, 2, tl.where((stage == 1) & done, 0, stage))
    stage = tl.where((stage == 2) & done, 0, stage)
    return stage, lo, hi, mk_lo, first, lo1


@triton.jit(do_not_specialize=["B"])
def _row_kernel(LOGITS, TEMP, TOP_K, TOP_P, MIN_P, SEEDS, OFFSETS, PF, PI, TMAX, TOKENS, LOGPROBS,
                stride_b, B, V, NC, NT, NS, BC: tl.constexpr, BNT: tl.constexpr,
                BT: tl.constexpr, TPC: tl.constexpr, NP: tl.constexpr, PASSES: tl.constexpr,
                FAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    cmask = c < NC
    row = b * NC + c
    m_c = tl.load(PF + row, mask=cmask, other=float("-inf"))
    s_c = tl.load(PF + B * NC + row, mask=cmask, other=0.0)
    zmin = tl.min(tl.load(PF + 2 * B * NC + row, mask=cmask, other=float("inf")), 0)
    best_c = tl.load(PF + 3 * B * NC + row, mask=cmask, other=float("-inf"))
    m = tl.max(m_c, 0)
    s = tl.sum(tl.where(m_c == float("-inf"), 0.0, s_c * tl.exp(m_c - m)), 0)
    a = tl.min(tl.where(m_c == m, tl.load(PI + row, mask=cmask, other=0), 2147483647), 0)
    best = tl.max(best_c, 0)
    w = tl.min(tl.where(best_c == best, tl.load(PI + B * NC + row, mask=cmask, other=0),
                        2147483647), 0)
    T = tl.load(TEMP + b)
    race = T > 0
    T = tl.where(race, T, 1.0)
    tok = tl.where(race, w, a)
    k = tl.load(TOP_K + b)
    top_p = tl.load(TOP_P + b)
    min_p = tl.load(MIN_P + b)
    k_on = (k > 0) & (k < V)
    if race & (k_on | (top_p < 1.0) | (min_p > 0.0)):
        # Both searches keep a bracket: every token with key <= lo fails, every token with
        # key >= hi passes. A pass evaluates 16 pivots, the lowest one just above the
        # smallest token key above lo (so the pass that isolates the threshold also ends the
        # search); done once no token lies strictly between lo and hi.
        hi0 = _okey(m).to(tl.int64)
        key_tm = _okey(m + tl.log(min_p)).to(tl.int64)  # min-p keeps key >= key_tm
        lo_k = tl.maximum(_okey(zmin).to(tl.int64), key_tm) - 1
        lo_pb = lo_k * 0 - 2147483649
        if k_on | (top_p < 1.0):  # bounds from the tile maxima t_1 >= t_2 >= ...
            i = tl.arange(0, BNT)
            ts = tl.sort(tl.load(TMAX + b * NT + i, mask=i < NT, other=-2147483648),
                         descending=True)
            if k_on & (k <= NT):  # tiles 1..k hold k tokens with key >= t_k: keys below fail
                lo_k = tl.maximum(lo_k, _pick(i, k - 1, ts).to(tl.int64) - 1)
            if top_p < 1.0:  # the maxima above a token alone hold at least this mass above it
                e = tl.where(ts > -2147483648, tl.exp(_zkey(ts) - m), 0.0)
                hit = tl.cumsum(e, 0) >= top_p * s * 1.0001  # as mass(A) <= s
                first_hit = tl.min(tl.where(hit, i, BNT), 0)
                if first_hit < BNT:
                    lo_pb = _pick(i, first_hit, ts).to(tl.int64) - 1
        lo = tl.where(k_on, lo_k, key_tm - 1)
        zero = lo * 0
        # top-k first (stage 1: fail iff key < key_tm or #{key above} >= k), then top-p within
        # A = {key > lo} (stage 2: fail iff mass above >= top_p * mass(A))
        stage, lo, hi, mk_lo, first, lo1 = _settle(zero + 1, lo, hi0, lo + 1,
                                                   (hi0 - lo <= 1) | ~k_on, zero, zero, lo_pb,
                                                   top_p, m, V)
        target = m * 0.0
        j = tl.arange(0, NP)
        for _ in range(2 * PASSES):
            if stage != 0:
                base = tl.maximum(mk_lo - 1, lo)  # keys <= base fail
                p1 = (stage == 2) & (first != 0)  # the first top-p pass: lane 0 measures mass(A)
                piv = tl.where((j == 0) & p1, lo1, _pivots(j, base, hi, NP))
                wsum, mk = _row_pass(LOGITS, TMAX, stride_b, b, V, NT, NS, T, m,
                                     piv.to(tl.int32), stage == 2, BT, TPC, NP)
                target = tl.where(p1, top_p * _pick(j, 0, wsum), target)
                fail = tl.where(stage == 1, (piv < key_tm) | (wsum >= k.to(tl.float32)),
                                wsum >= target)
                lo, mk_lo, hi, done = _narrow(j, piv, fail, mk, base, hi, NP)
                first = tl.where(p1, 0, first)
                stage, lo, hi, mk_lo, first, lo1 = _settle(stage, lo, hi, mk_lo, done, first, lo1,
                                                           lo_pb, top_p, m, V)
        z_w = tl.math.div_rn(tl.load(LOGITS + b * stride_b + w).to(tl.float32), T)
        if _okey(z_w).to(tl.int64) <= lo:  # the unfiltered winner is filtered out: race again
            key = _row_key(SEEDS, OFFSETS, b)
            best = m * 0.0 - float("inf")
            for cc in range(NS):  # chunks in order: on a tie the earlier (smaller) index wins
                best_cc, w_cc = _chunk_race(LOGITS, TMAX, stride_b, b, cc, V, NT, T, lo, key, BT,
                                            TPC, FAST)
                tok = tl.where(best_cc > best, w_cc, tok)
                best = tl.maximum(best, best_cc)
    z_tok = tl.math.div_rn(tl.load(LOGITS + b * stride_b + tok).to(tl.float32), T)
    tl.store(TOKENS + b, tok.to(tl.int64))
    tl.store(LOGPROBS + b, (z_tok - m) - tl.log(s))


def _check(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got shape {list(logits.shape)}")
    B = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("min_p", min_p), ("seeds", seeds), ("offsets", offsets)):
        if t.shape != (B,):
            raise ValueError(f"sample: {name} must be [{B}], got shape {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"sample: {name} is on {t.device}, logits on {logits.device}")


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    B, V = logits.shape
    dev = logits.device
    tokens = torch.empty(B, device=dev, dtype=torch.int64)
    logprobs = torch.empty(B, device=dev, dtype=torch.float32)
    if B == 0:
        return tokens, logprobs
    if V >= 2**31 - 2**20:
        raise ValueError(f"sample: V={V} must be < 2^31 - 2^20")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    top_k = top_k.to(torch.int32).contiguous()
    top_p, min_p = top_p.float().contiguous(), min_p.float().contiguous()
    seeds, offsets = seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    fast = not interpreting()
    c1, cr = CONFIGS["pass1"], CONFIGS["row"]
    CHUNK = min(c1["CHUNK"], triton.next_power_of_2(V))  # depends on V only, never on B
    BV = min(c1["BV"], CHUNK)
    BT = min(cr["BT"], BV)
    NC, NT = triton.cdiv(V, CHUNK), triton.cdiv(V, CHUNK) * (CHUNK // BT)
    SCHUNK = max(min(cr["CHUNK"], triton.next_power_of_2(V)), BT)  # tokens a search chunk
    # pass-1 partials: [4, B, NC] fp32, [2, B, NC] int32; tile keys [B, NT] int32
    pf = torch.empty(4 * B * NC, device=dev, dtype=torch.float32)
    pi, tmax = torch.empty(2 * B * NC + B * NT, device=dev, dtype=torch.int32).split(
        [2 * B * NC, B * NT])
    _pass1_kernel[(B, NC)](logits, temperature, seeds, offsets, pf, pi, tmax, logits.stride(0), B,
                           V, NC, NT, BV=BV, CHUNK=CHUNK, BT=BT, FAST=fast,
                           num_warps=c1["num_warps"])
    _row_kernel[(B,)](logits, temperature, top_k, top_p, min_p, seeds, offsets, pf, pi, tmax,
                      tokens, logprobs, logits.stride(0), B, V, NC, NT, triton.cdiv(V, SCHUNK),
                      BC=triton.next_power_of_2(NC), BNT=triton.next_power_of_2(NT), BT=BT,
                      TPC=SCHUNK // BT, NP=_NP, PASSES=_PASSES, FAST=fast,
                      num_warps=cr["num_warps"], maxnreg=cr.get("maxnreg"))
    return tokens, logprobs


# ----------------------------------------------------------------------------- the hash RNG
def _row_key_ref(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    s, o = seeds.long(), offsets.long()
    k = _hash32_ref((s & _M32) ^ 0x243F6A88)
    k = _hash32_ref(k ^ ((s >> 32) & _M32))
    k = _hash32_ref(k ^ (o & _M32))
    return _hash32_ref(k ^ ((o >> 32) & _M32))  # [B]


def _gumbel_ref(key: torch.Tensor, V: int) -> torch.Tensor:
    """[B] row keys -> [B, V] fp32 Gumbel noise -log(-log u), u = (2 r + 1) / 2^24 in (0, 1)."""
    i = torch.arange(V, device=key.device, dtype=torch.int64)[None, :]
    r = _hash32_ref((_hash32_ref(i ^ key[:, None]) + key[:, None]) & _M32)
    u = ((r >> 9) * 2 + 1).float() * (2.0**-24)  # 24-bit integer: exact in fp32
    return -torch.log(-torch.log(u))


# ------------------------------------------------------------------------------- the twin
def _kept_ref(z, top_k, top_p, min_p):
    """[B, V] bool: the tokens min-p, then top-k, then top-p keep (all sets closed under ties)."""
    B, V = z.shape
    zmax = z.max(-1, keepdim=True).values
    keep = z >= zmax + torch.log(min_p.float())[:, None]  # p_i >= min_p * p_max
    k_on = (top_k > 0) & (top_k < V)
    p_on = top_p < 1.0
    if not (bool(k_on.any()) or bool(p_on.any())):
        return keep
    zs, order = z.sort(-1, descending=True)
    # for each sorted position, the first position of its run of equal values
    first = torch.searchsorted(-zs, -zs, side="left")  # -zs is ascending
    if bool(k_on.any()):
        kth = zs.gather(1, (top_k.long() - 1).clamp(0, V - 1)[:, None])
        keep &= ~k_on[:, None] | (z >= kth)  # #{j: z_j > z_i} < k
    if bool(p_on.any()):
        p = torch.softmax(z, -1) * keep
        ps = p.gather(1, order)
        above_sorted = (ps.cumsum(-1) - ps).gather(1, first)  # mass strictly above, within kept
        above = torch.empty_like(above_sorted).scatter_(1, order, above_sorted)
        keep &= ~p_on[:, None] | (above < top_p[:, None] * p.sum(-1, keepdim=True))
    return keep


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    B, V = logits.shape
    greedy = temperature <= 0
    T = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    z = logits.float() / T[:, None]  # [B, V]
    logp = torch.log_softmax(z, -1)
    keep = _kept_ref(z, top_k, top_p, min_p)
    score = (z + _gumbel_ref(_row_key_ref(seeds, offsets), V)).masked_fill(~keep, float("-inf"))
    tokens = torch.where(greedy, z.argmax(-1), score.argmax(-1))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


@dispatch(sample_triton, sample_ref, on="logits")
def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """logits: [B, V] fp32|bf16; temperature [B] fp32 (0 = greedy); top_k [B] int32 (<= 0 or
    >= V = off); top_p [B] fp32 in (0, 1] (1 = off); min_p [B] fp32 in [0, 1] (0 = off);
    seeds, offsets [B] int64 -> (tokens [B] int64, logprobs [B] fp32), where
    logprobs = log_softmax(logits / T)[token] on the unfiltered distribution."""
    _check(logits, temperature, top_k, top_p, min_p, seeds, offsets)


def greedy(logits):
    """logits: [B, V] -> tokens [B] int64 (argmax, first index on ties)."""
    return logits.argmax(-1)
