"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, over the last dimension.

Used for the hidden-state norms ([T, D]) and for Qwen3's per-head q/k norms ([T*H, D]).
Statistics are fp32 whatever the input dtype; `rstd` is saved for the backward.

Backward, with xhat = x * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)

The kernels hold whole rows (D <= 8192) and pack several short rows into one program so
that the per-head norm (D = 128, millions of rows) moves as much data per program as the
hidden norm. The backward's dw is a column sum over all rows: each program of a fixed-size
grid sums its own rows (tiles pid, pid + P, pid + 2P, ...) into one row of an fp32 [P, D]
buffer, which is then summed in a fixed order, so dw is deterministic (no atomics).

Backward traffic: one read of dy and x, one write of dx (3 * N * D elements), xhat is
recomputed from x and rstd in registers; the [P, D] partials add P * D * 8 bytes (P = SMs x
programs per SM, ~0.5k: 2 MB against 200 MB at [32768, 1024]). The loop over a program's
tiles is software-pipelined (`tl.range(num_stages=3)`: the loads of the next two tiles are
in flight, through shared memory, while one is computed), dw is accumulated element-wise in
a [BN, BD] register tile and reduced over rows once at the end, and 2048-element tiles on 8
warps (64 registers) fit 4 programs an SM, 64 KB of loads in flight. Programs take
tiles pid, pid + P, pid + 2P, ... rather than a contiguous run of rows each: contiguous runs
put the programs' streams a power of two apart for the hidden norm (the same DRAM channels,
in lock step), which held its backward far below copy bandwidth whatever the pipelining
(bench/kernel_bench.py, bench/results/kernels.json).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton
from rlcu.ops.exact import tree_sum

MAX_D = 8192  # a row lives in one block
_TILE = 4096  # elements a program handles at once: BN rows of BD columns
_BWD_TILE = 2048  # the backward's tile (smaller: it also holds dw and pipelined loads)
_BWD_PROGRAMS_PER_SM = 8  # at most, in the backward's fixed grid (as many as fit on an SM)
_CPU_PROGRAMS = 3  # under the interpreter: few programs, so that each loops over several tiles
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_RESIDENT: dict = {}  # (device, dtypes, blocks) -> backward programs that fit on the GPU


@triton.jit(do_not_specialize=["N"])
def _rmsnorm_fwd_kernel(X, W, Y, RSTD, N, D, stride_x, stride_y, eps,
                        BN: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BN + tl.arange(0, BN)  # [BN]
    cols = tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)  # [BN]
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    # as the twin (and HF): the normalised x is rounded to x's dtype before the scale by w
    xhat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    y = xhat * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["N", "tiles_per_program"])
def _rmsnorm_bwd_kernel(DY, X, W, RSTD, RES, DX, DW_PART, N, D, stride_dy, stride_x, stride_res, stride_dx,
                        tiles_per_program, BN: tl.constexpr, BD: tl.constexpr,
                        STAGES: tl.constexpr, HAS_RES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    P = tl.num_programs(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BN, BD], dtype=tl.float32)  # summed over rows after the loop
    # grid-stride: at any moment the P programs read P consecutive tiles (one contiguous
    # stretch of memory), never P streams a power-of-two apart
    for t in tl.range(0, tiles_per_program, num_stages=STAGES):
        rows = (t * P + pid) * BN + tl.arange(0, BN)  # [BN]
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat)); padded rows give 0
        c = tl.sum(g * xhat, 1) / D  # [BN]
        dx = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_RES:  # a residual branch's gradient, added before the one rounding
            dx += tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid * D + cols, tl.sum(dw, 0), mask=cmask)


def _blocks(D: int):
    """Block shape [BN, BD] and warps for rows of length D."""
    BD = triton.next_power_of_2(D)
    BN = max(1, _TILE // BD)
    num_warps = 4 if BN * BD <= 4096 else 8 if BN * BD <= 8192 else 16
    return BN, BD, num_warps


def _blocks_bwd(D: int):
    """The backward's tile [BN, BD], warps and pipeline stages: ~8 elements a thread, so that
    with the pipelined loads four programs fit on an SM (see the module docstring)."""
    BD = triton.next_power_of_2(D)
    BN = max(1, _BWD_TILE // BD)
    num_warps = min(16, max(4, BN * BD // 256))
    # 64 registers: 4 programs of 8 warps an SM (ptxas picks 76 for bf16 [2, 1024], i.e. 3;
    # no spill at 64 for 16-bit inputs, 8 bytes for fp32 at D = 200)
    maxnreg = 64 if BN * BD <= _BWD_TILE else None
    return BN, BD, num_warps, (3 if BN * BD <= 4096 else 2), maxnreg


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A 2-D view with unit column stride (any row stride); copies only when needed."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {list(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    return t if (t.stride(1) == 1 or t.shape[1] <= 1) else t.contiguous()


def _check(x: torch.Tensor, w: torch.Tensor):
    N, D = x.shape
    if not 0 < D <= MAX_D:
        raise ValueError(f"rmsnorm: row length D={D} must be in [1, {MAX_D}]")
    if w.shape != (D,):
        raise ValueError(f"rmsnorm: w must have shape [{D}], got {list(w.shape)}")
    if w.device != x.device:
        raise ValueError(f"rmsnorm: w is on {w.device}, x on {x.device}")
    return N, D


def _resident_per_sm(device: torch.device, warm, num_warps: int) -> int:
    """How many programs of the kernel that `warm()` compiles fit on one SM at once
    (registers, threads, shared memory), so that the backward's fixed grid runs in whole waves."""
    try:
        compiled = warm()
        compiled._init_handles()
        p = torch.cuda.get_device_properties(device)
        threads = 32 * num_warps
        fit = min(getattr(p, "regs_per_multiprocessor", 65536) // max(1, compiled.n_regs * threads),
                  getattr(p, "max_threads_per_multi_processor", 2048) // threads)
        if compiled.metadata.shared:
            fit = min(fit, getattr(p, "shared_memory_per_multiprocessor", 228 * 1024) // compiled.metadata.shared)
        return max(1, min(fit, _BWD_PROGRAMS_PER_SM))
    except Exception:  # a Triton without these fields: only the wave shape suffers
        return 4


def _bwd_programs(device: torch.device, n_tiles: int, key, warm) -> int:
    """The backward's grid size; `warm()` compiles the kernel without launching it."""
    if device.type != "cuda":
        return min(n_tiles, _CPU_PROGRAMS)
    slots = _RESIDENT.get(key)
    if slots is None:  # programs that fit on the whole GPU at once
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        slots = _RESIDENT[key] = sms * _resident_per_sm(device, warm, key[-1])
    return max(1, min(n_tiles, slots))


def rmsnorm_fwd_triton(x: torch.Tensor, w: torch.Tensor, eps: float, exact: bool = False):
    # one kernel in both modes: a row's sum is one program's, whatever the number of rows
    x = _rows(x, "x")
    N, D = _check(x, w)
    w = w.contiguous()
    y = torch.empty(N, D, device=x.device, dtype=x.dtype)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    if N == 0:
        return y, rstd
    BN, BD, num_warps = _blocks(D)
    _rmsnorm_fwd_kernel[(triton.cdiv(N, BN),)](x, w, y, rstd, N, D, x.stride(0), y.stride(0), eps,
                                               BN=BN, BD=BD, num_warps=num_warps)
    return y, rstd


def rmsnorm_bwd_triton(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                       residual: torch.Tensor | None = None):
    x, dy = _rows(x, "x"), _rows(dy, "dy")
    N, D = _check(x, w)
    if dy.shape != x.shape:
        raise ValueError(f"rmsnorm: dy has shape {list(dy.shape)}, x has {list(x.shape)}")
    if residual is not None:
        residual = _rows(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"rmsnorm: residual has shape {list(residual.shape)}, x has {list(x.shape)}")
    if rstd.shape != (N,) or rstd.dtype != torch.float32:
        raise ValueError(f"rmsnorm: rstd must be fp32 [{N}], got {rstd.dtype} {list(rstd.shape)}")
    w, rstd = w.contiguous(), rstd.contiguous()
    dx = torch.empty(N, D, device=x.device, dtype=x.dtype)
    if N == 0:
        return dx, torch.zeros(D, device=x.device, dtype=torch.float32)
    BN, BD, num_warps, stages, maxnreg = _blocks_bwd(D)
    n_tiles = triton.cdiv(N, BN)

    def launch(grid, dw_part, tiles_per_program, warmup=False):
        res = dy if residual is None else residual  # dy stands in for an absent residual (never read)
        args = (dy, x, w, rstd, res, dx, dw_part, N, D, dy.stride(0), x.stride(0), res.stride(0), dx.stride(0),
                tiles_per_program)
        kw = dict(BN=BN, BD=BD, STAGES=stages, HAS_RES=residual is not None, num_warps=num_warps, maxnreg=maxnreg)
        if warmup:
            return _rmsnorm_bwd_kernel.warmup(*args, grid=grid, **kw)
        _rmsnorm_bwd_kernel[grid](*args, **kw)

    key = (x.device, dy.dtype, x.dtype, w.dtype, None if residual is None else residual.dtype, BN, BD, stages,
           num_warps)
    # rstd stands in for the fp32 partial buffer; any tiles_per_program >= 2 compiles the same
    P = _bwd_programs(x.device, n_tiles, key, lambda: launch((1,), rstd, 2, warmup=True))
    tiles_per_program = triton.cdiv(n_tiles, P)
    P = triton.cdiv(n_tiles, tiles_per_program)
    dw_part = torch.empty(P, D, device=x.device, dtype=torch.float32)  # [P, D]
    launch((P,), dw_part, tiles_per_program)
    return dx, dw_part.sum(0)


def rmsnorm_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float, exact: bool = False):
    xf = x.float()
    if exact:  # a fixed tree, and sqrt / division (torch's CPU rsqrt rounds by position)
        rstd = 1.0 / torch.sqrt(tree_sum(xf * xf) / x.shape[-1] + eps)
    else:
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)  # [N]
    y = (xf * rstd[:, None]).to(x.dtype) * w
    return y.to(x.dtype), rstd


def rmsnorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                    residual: torch.Tensor | None = None):
    xhat = x.float() * rstd[:, None]
    g = dy.float() * w.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if residual is not None:
        dx = dx + residual.float()
    dw = (dy.float() * xhat).sum(0)
    return dx.to(x.dtype), dw


@dispatch(rmsnorm_fwd_triton, rmsnorm_fwd_ref, on="x")
def rmsnorm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float, exact: bool = False):
    """x: [N, D], w: [D] -> (y [N, D] in x.dtype, rstd [N] fp32). exact: exact mode's twin (a
    fixed-tree sum; the kernel is the same in both modes)."""


@dispatch(rmsnorm_bwd_triton, rmsnorm_bwd_ref, on="x")
def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                residual: torch.Tensor | None = None):
    """dy, x: [N, D], w: [D], rstd: [N] -> (dx [N, D] in x.dtype, dw [D] fp32). residual
    [N, D], when given, is added to dx before its rounding: the gradient of a residual
    branch around the norm, in the same pass (one read instead of an add's two and a write)."""
