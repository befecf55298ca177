"""Bring a byte range of device memory into the L2 cache ahead of the kernels that read it.

A decode step's GEMMs at 1-256 rows are bound by latency, not by bytes: a cuBLAS GEMM over a
4-12 MB weight of the 0.6B shape takes 5-7 us where its bytes take 1-3 us at the copy
bandwidth, its programs waiting on one DRAM round trip after another. `l2_prefetch` launches
one short kernel whose programs each issue bulk L2 prefetches (`cp.async.bulk.prefetch.L2`,
sm_90: the copy engine fetches the bytes into L2, and the program does not wait for them) over
a range, so the kernel ends in about a launch's time while the bytes stream in at the memory's
rate and the following kernels find them in L2 (H200: 50 MB; the 0.6B shape's layer is 30 MB).

It is a hint: no value anywhere depends on it, so every backend may skip it. Off CUDA (the
twins, the interpreter, which has no inline assembly) it does nothing.

`CONFIGS["enabled"]` has the engine's decode steps prefetch, after each layer's attention, the
weights that layer and the next one's attention inputs read next (engine/paged_forward.py
`decode_prefetch`), at most `max_bytes` of them.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import interpreting, tl, triton, use_triton

CONFIGS = {
    "enabled": False,  # the engine's decode steps prefetch each layer's next weights (paged_forward)
    "chunk": 1 << 15,  # bytes one prefetch instruction asks for (a multiple of 16)
    "per_program": 32,  # prefetches a program issues (one warp, a lane each)
    "max_bytes": 40 << 20,  # at most this much of a range is prefetched (the head of it)
    "early": False,  # the engine asks before each layer's attention instead of after it
}


@triton.jit(do_not_specialize=["nbytes"])
def _l2_prefetch_kernel(X, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    # lane j of program p asks for bytes [c, c + CHUNK) of X, c = (p * PER + j) * CHUNK, cut at
    # nbytes; lanes past the end ask for X's first 16 bytes instead (a valid address)
    start = (tl.program_id(0).to(tl.int64) * PER + tl.arange(0, PER)) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK)
    live = size > 0
    ptrs = X + tl.where(live, start, 0)
    size = tl.where(live, size, 16).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r", [ptrs, size],
                              dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, lo: int, hi: int) -> None:
    """Ask for t's elements [lo, hi) (of its flat storage, from t's first element) in L2; at
    most CONFIGS["max_bytes"] from lo. t: a contiguous tensor whose first element is 16-byte
    aligned (the model's flat buffer). Returns at once; changes nothing."""
    if not 0 <= lo <= hi <= t.numel():
        raise ValueError(f"l2_prefetch: range [{lo}, {hi}) outside a tensor of {t.numel()} elements")
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: the tensor must be contiguous")
    if not use_triton(t) or interpreting():
        return  # a hint: the twins and the interpreter (no inline assembly) skip it
    es = t.element_size()
    if (t.data_ptr() + lo * es) % 16:
        raise ValueError("l2_prefetch: the range must start 16-byte aligned")
    nbytes = min((hi - lo) * es, CONFIGS["max_bytes"]) // 16 * 16
    if nbytes == 0:
        return
    chunk, per = CONFIGS["chunk"], CONFIGS["per_program"]
    if chunk % 16 or chunk <= 0:
        raise ValueError(f"l2_prefetch: CONFIGS['chunk'] = {chunk} must be a positive multiple of 16")
    x = t.view(-1)[lo:lo + nbytes // es].view(torch.uint8)
    grid = (triton.cdiv(nbytes, chunk * per),)
    _l2_prefetch_kernel[grid](x, nbytes, CHUNK=chunk, PER=per, num_warps=1)
