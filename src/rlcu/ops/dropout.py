"""Dropout's multiplier from a seed in device memory: m [N, K] = keep / (1 - p), keep ~ Bernoulli(1 - p).

The draw is counter-based (lowbias32 rounds, rlcu.ops._hash), a function of (seed, stream,
element index) alone:
    k = H(H(H(seed_lo ^ 0x243F6A88) ^ seed_hi) ^ stream),   r_e = H(H(e ^ k) + k),   keep_e = r_e >= p 2^32
The seed is READ from a tensor, never passed as a host number, so a CUDA graph that captures the
launch replays it with whatever seed the host (or the graph) wrote there before the replay: a
captured training step draws fresh masks every replay (train/step_graph.py), where a generator
seeded on the host would bake one mask into the graph. `stream` (a host int, fixed per call site:
layer, module, slice) gives each site its own masks under one seed. The kernel and the twin agree
bit for bit (integers, and the scale rounded to x's dtype once on the host), on any device.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton
from rlcu.ops._hash import M32, hash32_ref
from rlcu.ops._hash import hash32 as _hash32

BLOCK = 1024
_SALT = 0x243F6A88


# stream and n not specialised: the JIT makes an int argument equal to 1 a Python constant (no .to),
# and a new variant for each stream would be compiled otherwise
@triton.jit(do_not_specialize=["n", "stream"])
def _dropout_mask_kernel(SEED, OUT, n, stream, thresh, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(SEED)  # int64, the forward's seed
    k = _hash32((s & 0xFFFFFFFF).to(tl.uint32) ^ 0x243F6A88)
    k = _hash32(k ^ ((s >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _hash32(k ^ stream.to(tl.uint32))
    r = _hash32(_hash32(e.to(tl.uint32) ^ k) + k)
    keep = r.to(tl.int64) >= thresh
    m = tl.where(keep, scale, 0.0)
    tl.store(OUT + e, m.to(OUT.dtype.element_ty), mask=e < n)


def _thresh(p: float) -> int:
    return min(round(p * 2**32), M32)


def _scale(p: float, dtype: torch.dtype) -> float:
    """1 / (1 - p) rounded to dtype once, on the host: the kernel stores it exactly (whatever its
    conversions round like; the interpreter's bf16 is not the GPU's) and the twin multiplies 1 by it."""
    return float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float64).to(dtype))


def dropout_mask_triton(seed, stream, p, N, K, dtype):
    out = torch.empty(N, K, device=seed.device, dtype=dtype)
    n = N * K
    if n:
        _dropout_mask_kernel[(triton.cdiv(n, BLOCK),)](seed, out, n, stream, _thresh(p), _scale(p, dtype),
                                                        BLOCK=BLOCK, num_warps=4)
    return out


def dropout_mask_ref(seed, stream, p, N, K, dtype):
    s = seed.reshape(1).long()
    k = hash32_ref((s & M32) ^ _SALT)
    k = hash32_ref(k ^ ((s >> 32) & M32))
    k = hash32_ref(k ^ stream)
    e = torch.arange(N * K, device=seed.device, dtype=torch.int64)
    r = hash32_ref((hash32_ref(e ^ k) + k) & M32)
    return ((r >= _thresh(p)).to(dtype) * _scale(p, dtype)).view(N, K)


@dispatch(dropout_mask_triton, dropout_mask_ref, on="seed")
def dropout_mask(seed, stream, p, N, K, dtype):
    """seed: int64 [1] (or []) on the device, in [0, 2^62); stream: an int in [0, 2^32); p: the
    drop probability in [0, 1); N, K: the mask's shape (N K < 2^32); dtype: the mask's (x's).
    -> [N, K] of dtype: 1 / (1 - p) where kept, 0 where dropped (multiply x by it)."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"dropout_mask: seed must be one int64 element, got {seed.dtype} {list(seed.shape)}")
    if not 0 <= stream < 2**32:
        raise ValueError(f"dropout_mask: stream must be in [0, 2^32), got {stream}")
    if not 0 <= p < 1:
        raise ValueError(f"dropout_mask: p must be in [0, 1), got {p}")
    if N * K >= 2**32:
        raise ValueError(f"dropout_mask: {N} x {K} elements: the element counter is 32 bits")
