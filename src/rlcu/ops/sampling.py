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
`_hash32_ref`), so a row's draw depends on (its logits, seed, offset) alone, never on the
batch it sits in, and the twin (int64 torch ops) and the kernels (uint32) draw the same token.
(On the GPU the outer log of g is lg2.approx, ~1e-6 off: only a near-tie can differ.)
logprobs = log_softmax(z)[token] on the UNFILTERED distribution, as the trainer recomputes it.

Kernels. Pass 1 splits each row into fixed chunks of the vocabulary (the split depends on V
only, so a row's sums do not change with the batch) and computes per chunk the online max /
sum-exp, the argmax and the race winner over all tokens; the finish kernel (one program per
row) combines them into lse, the greedy token, the unfiltered winner and its logprob. That is
one read of the logits for temperature-only sampling, the usual case in RL.

Rows with filters continue in the finish kernel with a threshold search instead of a sort:
each kept set above is {i : key(z_i) > lo} for the order-preserving int32 key of the float z,
and "token i fails" is monotone in key(z_i), so lo (the largest failing key) is found by a
bracket search: a pass reads the row once and evaluates 16 pivot keys at once (the number of
tokens, their mass exp(z - max), and the smallest key strictly above each pivot); the bracket
shrinks 15-fold per pass (at most 9 passes for any 32-bit range), and the lowest pivot of the
next pass is the smallest token key above lo, so the search stops as soon as the threshold
token is isolated: typically 3-5 passes for top-k (with min-p), 3-5 for top-p (which starts
above the tokens with p < (1 - top_p) / 2V, which always fail). A sort would cost O(V log V)
work and a [B, V] buffer; the search keeps no buffer, needs no host sync (the sampler can be
captured in a CUDA graph) and is exact. Then the unfiltered winner stands if it is kept (a
race over a subset is won by the overall winner whenever it is in the subset), else one more
pass races over the kept set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rlcu.ops._backend import interpreting, use_triton

_M32 = 0xFFFFFFFF
_NP = 16  # pivots a search pass evaluates
# pass 1: BV a tile, CHUNK of the vocabulary a program (a constant: sums must not depend on B);
# finish: BV a tile of the search passes (bench/kernel_suites/engine_ops.py --sweep)
CONFIGS = {
    "pass1": dict(BV=1024, CHUNK=8192, num_warps=4),
    "finish": dict(BV=256, num_warps=8),
}
_PASSES = 9  # passes of 15 new pivots that pin any 32-bit key (2^32 -> 1)


@triton.jit
def _hash32(x):
    # lowbias32 on uint32 (wraps mod 2^32), the same map as _hash32_ref
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


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
def _pass1_kernel(LOGITS, TEMP, SEEDS, OFFSETS, PF, PI, stride_b, B, V, NC,
                  BV: tl.constexpr, CHUNK: tl.constexpr, FAST: tl.constexpr):
    # per (row, chunk): max m, sum exp(z - m), min z, argmax, race winner (score, index)
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
def _pivot_pass(LOGITS, stride_b, b, V, T, m, piv, BV: tl.constexpr, NP: tl.constexpr,
                COUNT: tl.constexpr, MASS: tl.constexpr):
    # for each pivot key p: #{key > p} (if COUNT), the mass sum_{key > p} exp(z - m) (if MASS)
    # and the smallest key above p (which tells when the bracket has isolated the threshold)
    cnt = tl.zeros([BV, NP], tl.int32)
    mass = tl.zeros([BV, NP], tl.float32)
    mk = tl.full([BV, NP], 2147483647, tl.int32)
    for i in range(0, V, BV):
        idx = i + tl.arange(0, BV)
        z = tl.load(LOGITS + b * stride_b + idx, mask=idx < V, other=float("-inf"))
        z = tl.math.div_rn(z.to(tl.float32), T)
        key = tl.where(idx < V, _okey(z), -2147483648)[:, None]  # [BV, 1]
        gt = key > piv[None, :]  # [BV, NP]
        if COUNT:
            cnt += gt.to(tl.int32)
        mk = tl.minimum(mk, tl.where(gt, key, 2147483647))
        if MASS:
            mass += tl.where(gt, tl.exp(z - m)[:, None], 0.0)
    return tl.sum(cnt, 0), tl.sum(mass, 0), tl.min(mk, 0)


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
def _finish_kernel(LOGITS, TEMP, TOP_K, TOP_P, MIN_P, SEEDS, OFFSETS, PF, PI, TOKENS, LOGPROBS,
                   stride_b, B, V, NC, BC: tl.constexpr, BV: tl.constexpr, NP: tl.constexpr,
                   PASSES: tl.constexpr, FAST: tl.constexpr):
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
        j = tl.arange(0, NP)
        hi0 = _okey(m).to(tl.int64)  # every condition holds at the maximum
        key_tm = _okey(m + tl.log(min_p)).to(tl.int64)  # min-p keeps key >= key_tm
        lo = key_tm - 1
        if k_on:  # top-k and min-p: fail iff key < key_tm or #{key above} >= k
            lo = tl.maximum(_okey(zmin).to(tl.int64), key_tm) - 1
            mk_lo = lo + 1
            hi = hi0
            done = hi - lo <= 1
            for _ in range(PASSES):
                if not done:
                    base = tl.maximum(mk_lo - 1, lo)  # keys <= base fail
                    piv = _pivots(j, base, hi, NP)
                    cnt, mass, mk = _pivot_pass(LOGITS, stride_b, b, V, T, m, piv.to(tl.int32),
                                                BV, NP, True, False)
                    lo, mk_lo, hi, done = _narrow(j, piv, (piv < key_tm) | (cnt >= k), mk, base,
                                                  hi, NP)
        if top_p < 1.0:  # within A = {key > lo}: fail iff mass above >= top_p * mass(A)
            lo1 = lo
            # tokens with exp(z - m) <= (1 - top_p) / V fail, as mass(A) >= 1 (halved: margin)
            lo = tl.maximum(lo1, _okey(m + tl.log(0.5 * (1.0 - top_p) / V)).to(tl.int64) - 1)
            mk_lo = lo + 1
            hi = hi0
            done = hi - lo <= 1
            target = 0.0
            for it in range(PASSES):
                if not done:
                    base = tl.maximum(mk_lo - 1, lo)  # keys <= base fail
                    piv = _pivots(j, base, hi, NP)
                    if it == 0:
                        piv = tl.where(j == 0, lo1, piv)  # lane 0 measures mass(A)
                    cnt, mass, mk = _pivot_pass(LOGITS, stride_b, b, V, T, m, piv.to(tl.int32),
                                                BV, NP, False, True)
                    if it == 0:
                        target = top_p * _pick(j, 0, mass)
                    lo, mk_lo, hi, done = _narrow(j, piv, mass >= target, mk, base, hi, NP)
        z_w = tl.math.div_rn(tl.load(LOGITS + b * stride_b + w).to(tl.float32), T)
        if _okey(z_w).to(tl.int64) <= lo:  # the unfiltered winner is filtered out: race again
            key = _row_key(SEEDS, OFFSETS, b)
            bv = tl.full([BV], float("-inf"), tl.float32)
            bi = tl.zeros([BV], tl.int32)
            for i in range(0, V, BV):
                idx = i + tl.arange(0, BV)
                z = tl.load(LOGITS + b * stride_b + idx, mask=idx < V, other=float("-inf"))
                z = tl.math.div_rn(z.to(tl.float32), T)
                kept = (idx < V) & (_okey(z).to(tl.int64) > lo)
                sc = tl.where(kept, z + _gumbel(key, idx, FAST), float("-inf"))
                upd = sc > bv
                bi = tl.where(upd, idx.to(tl.int32), bi)
                bv = tl.where(upd, sc, bv)
            tok = tl.min(tl.where(bv == tl.max(bv, 0), bi, 2147483647), 0)
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
    tokens = torch.empty(B, device=logits.device, dtype=torch.int64)
    logprobs = torch.empty(B, device=logits.device, dtype=torch.float32)
    if B == 0:
        return tokens, logprobs
    if V >= 2**31:
        raise ValueError(f"sample: V={V} must be < 2^31")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    top_k = top_k.to(torch.int32).contiguous()
    top_p, min_p = top_p.float().contiguous(), min_p.float().contiguous()
    seeds, offsets = seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    fast = not interpreting()
    c1, cf = CONFIGS["pass1"], CONFIGS["finish"]
    CHUNK = min(c1["CHUNK"], triton.next_power_of_2(V))  # depends on V only, never on B
    NC = triton.cdiv(V, CHUNK)
    pf = torch.empty(4, B, NC, device=logits.device, dtype=torch.float32)
    pi = torch.empty(2, B, NC, device=logits.device, dtype=torch.int32)
    _pass1_kernel[(B, NC)](logits, temperature, seeds, offsets, pf, pi, logits.stride(0), B, V,
                           NC, BV=min(c1["BV"], CHUNK), CHUNK=CHUNK, FAST=fast,
                           num_warps=c1["num_warps"])
    _finish_kernel[(B,)](logits, temperature, top_k, top_p, min_p, seeds, offsets, pf, pi, tokens,
                         logprobs, logits.stride(0), B, V, NC, BC=triton.next_power_of_2(NC),
                         BV=cf["BV"], NP=_NP, PASSES=_PASSES, FAST=fast,
                         num_warps=cf["num_warps"])
    return tokens, logprobs


# ----------------------------------------------------------------------------- the hash RNG
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a bijection of 32-bit integers), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


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


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """logits: [B, V] fp32|bf16; temperature [B] fp32 (0 = greedy); top_k [B] int32 (<= 0 or
    >= V = off); top_p [B] fp32 in (0, 1] (1 = off); min_p [B] fp32 in [0, 1] (0 = off);
    seeds, offsets [B] int64 -> (tokens [B] int64, logprobs [B] fp32), where
    logprobs = log_softmax(logits / T)[token] on the unfiltered distribution."""
    _check(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    if use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)


def greedy(logits):
    """logits: [B, V] -> tokens [B] int64 (argmax, first index on ties)."""
    return logits.argmax(-1)
