"""Which implementation an op runs: the Triton kernel or the PyTorch reference twin.

`RLCU_BACKEND=torch|triton` forces one; unset, CUDA tensors take Triton and everything
else takes the twin. `RLCU_BACKEND=triton` with `TRITON_INTERPRET=1` runs the kernels on
CPU tensors through Triton's interpreter (slow, for tests).
"""

from __future__ import annotations

import os

import torch

try:  # triton ships with CUDA torch; on a CPU-only machine it is optional
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    HAS_TRITON = False

_CHOICES = ("torch", "triton")


def backend_name(device: torch.device | str | None = None) -> str:
    """The backend ops use for tensors on `device` (for `rlcu info`)."""
    forced = os.environ.get("RLCU_BACKEND", "").strip().lower()
    if forced:
        if forced not in _CHOICES:
            raise ValueError(f"RLCU_BACKEND={forced!r}: allowed values are {', '.join(_CHOICES)}")
        if forced == "triton" and not HAS_TRITON:
            raise RuntimeError("RLCU_BACKEND=triton but the triton package cannot be imported")
        return forced
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "triton" if (dev.type == "cuda" and HAS_TRITON) else "torch"


def use_triton(x: torch.Tensor) -> bool:
    """True when the op on tensor `x` should run its Triton kernel."""
    return backend_name(x.device) == "triton"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"
