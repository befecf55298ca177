"""AdamW over flat buffers in one memory-bound pass (the weights fp32 or bf16, the moments
fp32 or bf16), and the global gradient norm for clipping.

Decoupled weight decay, as torch.optim.AdamW, with c1 = 1 - b1^t, c2 = 1 - b2^t:
    p <- p (1 - lr wd);  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    p <- p - (lr / c1) m / (sqrt(v) / sqrt(c2) + eps)
`g` is the raw gradient times `grad_scale` (a Python float, or a 0-d fp32 tensor on the
device that the kernel reads through a pointer, so that the clip factor never has to
visit the host). The math is fp32 whatever the storage.

Weights p: fp32 (the fp32 master; the bf16 working copy `p_out` is written in the same pass,
rounded to nearest), or bf16 with no master at all. A bf16 weight cannot hold an update
smaller than half its ulp (2^-9 to 2^-8 of |p|): round-to-nearest would drop every update
|lr * m_hat / (sqrt(v_hat) + eps)| below that, nearly all of them at RL learning rates
(~lr per step). So the new value is written back with STOCHASTIC ROUNDING: for x in fp32
with bit pattern b,
    sr(x) = top 16 bits of (b + r),  r uniform in [0, 2^16)
rounds |x| up to the next bf16 with probability (b & 0xFFFF) / 2^16 and down otherwise, so
E[sr(x)] = x exactly and small updates survive in expectation (NaN stays NaN). The moments m, v may be bf16
too (stored the same way, unbiased; v >= 0 stays >= 0, so sqrt(v) is always defined, and
bf16 has fp32's 8-bit exponent: g^2 neither overflows nor flushes any sooner than in fp32).

The random bits are a counter-based hash (lowbias32 rounds, as the sampler's RNG) of
(seed, step, element index): r = H(H(lo ^ k) + k), k = H(key(seed, step) ^ hi) for the
index's 32-bit halves lo, hi. They depend on nothing else, so a resumed run rounds exactly
as an uninterrupted one, and the twin (int64 torch ops) draws the same bits as the kernel
(uint32). The kernel's fp32 math is one IEEE-rounded op at a time (no FMA contraction,
div_rn, sqrt_rn) in the twin's order, so kernel and twin agree bit for bit.

Per element the step reads p, g, m, v and writes p, m, v (and p_out): 28-30 bytes with an
fp32 master and fp32 moments, 16 (bf16 p, m, v and an fp32 g) without; the hashes (~40
integer ops an element) hide under the memory traffic.

The norm is a deterministic tree reduction, no atomics: one program per block writes the
block's sum of squares, the partial sums are summed again the same way while more than a
block of them remain, and one program adds the last ones and takes the root. (No kernel
loops over a runtime bound: the Triton interpreter with numpy >= 2.4 cannot take one.)
"""

from __future__ import annotations

import math

import torch

from rlcu.ops._backend import HAS_TRITON, use_triton
from rlcu.ops._hash import M32 as _M32
from rlcu.ops._hash import hash32_ref as _hash32_ref
from rlcu.ops._hash import py_hash32 as _py_hash32

if HAS_TRITON:
    import triton
    import triton.language as tl

    from rlcu.ops._hash import hash32 as _hash32

# (elements per program, warps) of the step: with stochastic rounding (a bf16 p or bf16
# moments) and without; bench/kernel_suites/logprob_adamw.py --sweep times the candidates.
# With rounding bits, 8 elements a thread (2048, 8) keeps fewer registers live than 16 and
# holds more warps in flight: the 4B shape's step took 14.7 ms (89% of copy) against 24.3 ms
# at (4096, 8) on the H200 (bench/results/adamw_bf16_sweep.json); the bits do not depend on it.
LAUNCH = {"sr": (2048, 8), "plain": (4096, 8)}
NORM_BLOCK = 4096  # elements summed by one program of the norm
REF_CHUNK = 1 << 22  # elements per pass of the twin (bounds its int64 temporaries)
_V_SALT = 0x9E3779B9  # v's rounding bits: H(r ^ salt), independent of p's and m's halves of r


if HAS_TRITON:

    @triton.jit
    def _to_f32(x):
        # exact; a bf16 by its bits (it is the top half of an fp32), since the interpreter's
        # float conversion mishandles subnormals
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _sround_bf16(x, r16):
        # fp32 x -> bf16: add r16 in [0, 2^16) to the 16 bits bf16 drops and keep the top half
        # (a carry rounds |x| up: P = dropped / 2^16); NaN -> the canonical bf16 NaN
        b = x.to(tl.uint32, bitcast=True)
        hi = tl.where(x == x, (b + r16) >> 16, 0x7FC0)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _rounding_bits(Key, offs, first, BLOCK: tl.constexpr):
        # r = H(H(lo ^ k) + k), k = H(key ^ hi) for the index's 32-bit halves lo, hi. A block's
        # indices [first, first + BLOCK) span at most two values of hi, so k is hashed twice a
        # program, not once an element (the bf16 mode's step hashes three times an element)
        key = Key.to(tl.uint32, bitcast=True)
        hi0 = first >> 32
        k0 = _hash32(key ^ hi0.to(tl.uint32))
        k1 = _hash32(key ^ ((first + BLOCK - 1) >> 32).to(tl.uint32))
        k = tl.where((offs >> 32) == hi0, k0, k1)
        return _hash32(_hash32(offs.to(tl.uint32) ^ k) + k)

    @triton.jit(do_not_specialize=["Key"])
    def _adamw_kernel(P, G, M, V, Pout, Scale, Coef, KeyPtr, n, Key, Base, scale, beta1, omb1, beta2, omb2, eps,
                      decay, step_size, inv_bc2_sqrt, SCALE_PTR: tl.constexpr, HAS_OUT: tl.constexpr,
                      SR_P: tl.constexpr, SR_MV: tl.constexpr, COEF_PTR: tl.constexpr, BLOCK: tl.constexpr):
        # omb = 1 - beta, step_size = lr / c1, inv_bc2_sqrt = 1 / sqrt(c2), decay = 1 - lr wd,
        # folded on the host; every line below is the twin's (_adamw_block_ref), op for op.
        # COEF_PTR: the step's scalars (decay, step_size, inv_bc2_sqrt, gate) and the rounding key
        # are read from device memory, so that one captured launch serves every step (a CUDA
        # graph); gate 0 (a non-finite loss or norm, found on the device) leaves everything as it was
        if COEF_PTR:
            if tl.load(Coef + 3) == 0.0:
                return
            decay = tl.load(Coef)
            step_size = tl.load(Coef + 1)
            inv_bc2_sqrt = tl.load(Coef + 2)
            Key = tl.load(KeyPtr)
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = _to_f32(tl.load(P + offs, mask=mask, other=0.0))
        g = _to_f32(tl.load(G + offs, mask=mask, other=0.0))
        m = _to_f32(tl.load(M + offs, mask=mask, other=0.0))
        v = _to_f32(tl.load(V + offs, mask=mask, other=0.0))
        if SCALE_PTR:
            g = g * tl.load(Scale).to(tl.float32)
        else:
            g = g * scale
        m = m * beta1 + g * omb1
        v = v * beta2 + g * g * omb2
        d = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
        p = p * decay - tl.math.div_rn(m, d) * step_size
        r = offs.to(tl.uint32)  # [BLOCK] the rounding bits (unused without rounding)
        if SR_P or SR_MV:
            # Base: the slice's first index in the full buffer
            r = _rounding_bits(Key, offs + Base, pid * BLOCK + Base, BLOCK)
        if SR_P:
            tl.store(P + offs, _sround_bf16(p, r >> 16), mask=mask)
        else:
            tl.store(P + offs, p, mask=mask)
        if SR_MV:
            tl.store(M + offs, _sround_bf16(m, r & 0xFFFF), mask=mask)
            tl.store(V + offs, _sround_bf16(v, _hash32(r ^ 0x9E3779B9) >> 16), mask=mask)  # _V_SALT
        else:
            tl.store(M + offs, m, mask=mask)
            tl.store(V + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(Pout + offs, p.to(Pout.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_sum_kernel(X, Out, n, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
        # Out[i] = sum over block i of x^2 (SQUARE) or of x, in fp32
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        if SQUARE:
            x = x * x
        tl.store(Out + pid, tl.sum(x, 0))

    @triton.jit
    def _sum_sqrt_kernel(Partial, Out, n_part, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(Partial + offs, mask=offs < n_part, other=0.0)
        tl.store(Out, tl.sqrt(tl.sum(x, 0)))


def _coefs(lr, beta1, beta2, eps, weight_decay, step) -> dict:
    """The step's scalars, folded once on the host in float64 (both backends round each to
    fp32 the same way when they use it)."""
    return dict(beta1=beta1, omb1=1.0 - beta1, beta2=beta2, omb2=1.0 - beta2, eps=eps,
                decay=1.0 - lr * weight_decay, step_size=lr / (1.0 - beta1**step),
                inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2**step))


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of a step's stochastic-rounding bits (seed, step: any ints >= 0)."""
    k = _py_hash32((seed & _M32) ^ 0x243F6A88)
    k = _py_hash32(k ^ ((seed >> 32) & _M32))
    k = _py_hash32(k ^ (step & _M32))
    return _py_hash32(k ^ ((step >> 32) & _M32))


def _int32_bits(key: int) -> int:
    return key - (1 << 32) if key >= 1 << 31 else key  # the key's bits as an int32


def _adamw_step_triton(p, g, m, v, p_out, c: dict, key: int, grad_scale, index_base: int = 0, dev=None):
    """dev: None, or (coef, key) device tensors that replace c's step scalars and `key` (see
    adamw_step_device)."""
    n = p.numel()
    if n == 0:
        return
    scale_ptr = isinstance(grad_scale, torch.Tensor)
    if scale_ptr and (grad_scale.numel() != 1 or grad_scale.device != p.device):
        raise ValueError(f"grad_scale must be a float or a 1-element tensor on {p.device}, "
                         f"got shape {list(grad_scale.shape)} on {grad_scale.device}")
    sr_p, sr_mv = p.dtype == torch.bfloat16, m.dtype == torch.bfloat16
    block, warps = LAUNCH["sr" if sr_p or sr_mv else "plain"]
    grid = (triton.cdiv(n, block),)
    coef, key_t = dev if dev is not None else (p, p)
    _adamw_kernel[grid](
        p, g, m, v, p_out if p_out is not None else p, grad_scale if scale_ptr else p, coef, key_t, n,
        _int32_bits(key), index_base,
        1.0 if scale_ptr else float(grad_scale), c["beta1"], c["omb1"], c["beta2"], c["omb2"], c["eps"],
        c["decay"], c["step_size"], c["inv_bc2_sqrt"],
        SCALE_PTR=scale_ptr, HAS_OUT=p_out is not None, SR_P=sr_p, SR_MV=sr_mv, COEF_PTR=dev is not None,
        BLOCK=block, num_warps=warps, enable_fp_fusion=False)


def _grad_norm_triton(g: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((), device=g.device, dtype=torch.float32)
    if g.numel() == 0:
        return out
    x, square = g, True
    while square or x.numel() > NORM_BLOCK:  # 596M -> 146k -> 36 partial sums
        n = x.numel()
        part = torch.empty(triton.cdiv(n, NORM_BLOCK), device=g.device, dtype=torch.float32)
        _block_sum_kernel[(part.numel(),)](x, part, n, SQUARE=square, BLOCK=NORM_BLOCK, num_warps=8)
        x, square = part, False
    _sum_sqrt_kernel[(1,)](x, out, x.numel(), BLOCK=max(16, triton.next_power_of_2(x.numel())))
    return out


# ---------------------------------------------------------------- the twin
def rounding_bits_ref(key: int, start: int, n: int, device=None) -> torch.Tensor:
    """[n] int64 holding the uint32 r of elements start .. start+n-1 (p takes r >> 16, m
    takes r & 0xFFFF, v takes H(r ^ salt) >> 16)."""
    i = torch.arange(start, start + n, device=device, dtype=torch.int64)
    k = _hash32_ref((i >> 32) ^ key)
    return _hash32_ref((_hash32_ref((i & _M32) ^ k) + k) & _M32)


def sround_bf16_ref(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 x, r16 int64 in [0, 2^16) -> bf16: x rounded up or down, E[out] = x (see top)."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    hi = torch.where(torch.isnan(x), 0x7FC0, ((b + r16) >> 16) & 0xFFFF)
    return torch.where(hi >= 1 << 15, hi - (1 << 16), hi).to(torch.int16).view(torch.bfloat16)


def _adamw_block_ref(p, g, m, v, p_out, c: dict, key: int, start: int, grad_scale) -> None:
    gf = g.float() * grad_scale
    mf = m.float() * c["beta1"] + gf * c["omb1"]
    vf = v.float() * c["beta2"] + gf * gf * c["omb2"]
    # sqrt and / correctly rounded to fp32, as sqrt_rn and div_rn (torch's fp32 sqrt on the CPU
    # is not: via fp64, whose 53 bits make the double rounding exact)
    d = vf.double().sqrt().float() * c["inv_bc2_sqrt"] + c["eps"]
    pf = p.float() * c["decay"] - (mf.double() / d.double()).float() * c["step_size"]
    sr_p, sr_mv = p.dtype == torch.bfloat16, m.dtype == torch.bfloat16
    if sr_p or sr_mv:
        r = rounding_bits_ref(key, start, p.numel(), p.device)
        if sr_p:
            pf = sround_bf16_ref(pf, r >> 16)
        if sr_mv:
            mf = sround_bf16_ref(mf, r & 0xFFFF)
            vf = sround_bf16_ref(vf, _hash32_ref(r ^ _V_SALT) >> 16)
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)
    if p_out is not None:
        p_out.copy_(pf)


def adamw_step_ref(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed: int = 0,
                   index_base: int = 0):
    c = _coefs(lr, beta1, beta2, eps, weight_decay, step)
    key = rounding_key(seed, step)
    n = p.numel()
    for a in range(0, n, REF_CHUNK):
        b = min(n, a + REF_CHUNK)
        _adamw_block_ref(p[a:b], g[a:b], m[a:b], v[a:b], None if p_out is None else p_out[a:b], c, key,
                         index_base + a, grad_scale)


def grad_norm_ref(g: torch.Tensor) -> torch.Tensor:
    return g.float().pow(2).sum().sqrt()


# ---------------------------------------------------------------- public
def grad_norm(g: torch.Tensor) -> torch.Tensor:
    """g: [P] -> 0-d fp32 tensor, the L2 norm."""
    if use_triton(g):
        return _grad_norm_triton(g.reshape(-1))
    return grad_norm_ref(g)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """0-d norm -> 0-d fp32 min(1, max_norm / (norm + 1e-6)), on norm's device (no sync)."""
    return torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)


def adamw_step(p, g, m, v, p_out, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int, grad_scale, seed: int = 0, index_base: int = 0):
    """In place. p: [P] fp32 (a master) or bf16 (the weights themselves, written back with
    stochastic rounding); m, v: [P] both fp32 or both bf16 (stochastic rounding); g: [P] any
    float dtype; p_out: [P] working weights or None (when the weights are p itself; must be
    None for a bf16 p); grad_scale: float or a 1-element fp32 tensor on p's device; step:
    the 1-based step count; seed: with step and the element index, the rounding bits;
    index_base: the index in the full buffer of p[0] when p is a slice of it (a data-parallel
    shard), so that a slice draws the rounding bits the whole buffer would."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based, for the bias correction), got {step}")
    if p.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"p must be fp32 (a master copy) or bf16 (rounded stochastically), got {p.dtype}")
    if m.dtype != v.dtype or m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"m and v must be both fp32 or both bf16, got {m.dtype} and {v.dtype}")
    if p_out is not None and p.dtype != torch.float32:
        raise ValueError("p_out is the working copy of an fp32 master: it must be None when p is bf16")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if use_triton(p):
        for name, x in (("p", p), ("g", g), ("m", m), ("v", v), ("p_out", p_out)):
            if x is not None and (x.numel() != p.numel() or not x.is_contiguous()):
                raise ValueError(f"{name} must be contiguous with p's {p.numel()} elements")
        _adamw_step_triton(p, g, m, v, p_out, _coefs(lr, beta1, beta2, eps, weight_decay, step),
                           rounding_key(seed, step), grad_scale, index_base)
        return
    adamw_step_ref(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed, index_base)


# ---------------------------------------------------------------- scalars on the device
COEF_FIELDS = ("decay", "step_size", "inv_bc2_sqrt", "gate")


def step_coefs(lr: float, beta1: float, beta2: float, weight_decay: float, step: int, seed: int = 0):
    """The per-step inputs of `adamw_step_device`: ([decay, step_size, inv_bc2_sqrt, 1.0] as fp32
    values, the rounding key as an int32), folded as `adamw_step` folds them, so that a step
    fed from device memory computes what the same step with Python scalars computes, bit for bit
    (Triton rounds a float argument to fp32 the same way: to nearest)."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based, for the bias correction), got {step}")
    c = _coefs(lr, beta1, beta2, 0.0, weight_decay, step)
    vals = torch.tensor([c["decay"], c["step_size"], c["inv_bc2_sqrt"], 1.0], dtype=torch.float64).float()
    return vals, torch.tensor([_int32_bits(rounding_key(seed, step))], dtype=torch.int32)


def adamw_step_device(p, g, m, v, p_out, coef: torch.Tensor, key: torch.Tensor, *, beta1: float, beta2: float,
                      eps: float, grad_scale: torch.Tensor, index_base: int = 0):
    """`adamw_step` with the step's scalars in device memory, for a launch captured once in a
    CUDA graph and replayed every step: coef [4] fp32 = (decay, step_size, inv_bc2_sqrt, gate)
    as `step_coefs` makes them (gate 0: skip the update, nothing is written), key [1] int32;
    grad_scale a 1-element fp32 tensor. Triton only (a graph is a CUDA thing)."""
    if not use_triton(p):
        raise RuntimeError("adamw_step_device runs the Triton kernel only (CUDA graphs, or TRITON_INTERPRET=1)")
    if coef.dtype != torch.float32 or coef.numel() != 4 or key.dtype != torch.int32 or key.numel() != 1:
        raise ValueError(f"coef must be 4 fp32 values and key 1 int32, got {coef.dtype} [{coef.numel()}] "
                         f"and {key.dtype} [{key.numel()}]")
    if not isinstance(grad_scale, torch.Tensor):
        raise TypeError("grad_scale must be a 1-element device tensor here")
    c = _coefs(1.0, beta1, beta2, eps, 0.0, 1)  # beta1, omb1, beta2, omb2, eps; the rest comes from coef
    _adamw_step_triton(p, g, m, v, p_out, c, 0, grad_scale, index_base, dev=(coef, key))
