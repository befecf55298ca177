"""lowbias32, the counter-based hash behind every random draw of the kernels (the sampler's
Gumbel noise, AdamW's stochastic rounding), in three forms that agree bit for bit:
    x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16   (mod 2^32)
- `hash32`: Triton, on uint32 tensors (the multiplications wrap);
- `hash32_ref`: torch, on int64 tensors holding uint32 values (the twins);
- `py_hash32`: a Python int (keys derived on the host).
A draw is a function of its counters alone (seed, step or offset, element index), so it
never depends on the batch, the launch grid or the backend.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import tl, triton  # noqa: F401  (the interpreter wants tl in a jit function's globals)

M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B


@triton.jit
def hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow (c split in 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = mul32(x, _C1)
    x = x ^ (x >> 15)
    x = mul32(x, _C2)
    return x ^ (x >> 16)


def py_hash32(x: int) -> int:
    """lowbias32 of a Python int (taken mod 2^32)."""
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 16)
