"""Programmatic dependent launch (PDL, sm_90 and later) for the small kernels of a decode step.

A decode step is a chain of ~10 kernels a layer, most of a few microseconds; between two of
them the GPU drains the first, flushes its writes and only then launches the second (about a
microsecond a boundary inside a CUDA graph: bench/decode_step.py's `serial - kernels`). A
kernel launched with programmatic stream serialisation (`launch_pdl`) may be launched before
the kernel ahead of it has finished: its programs become resident and wait at
`griddepcontrol.wait` until that kernel has completed and its writes are visible. So the
launch, the programs' placement and their first instructions overlap the previous kernel's
tail.

The protocol every PDL kernel here follows (`enter`, its first statement): wait first, then
allow the next kernel to launch. So when a PDL kernel starts running past `enter`, the kernel
before it has completed, and when its successor launches, every program of it has passed its
wait: every kernel before it has completed too. A kernel may therefore read anything written
before it, exactly as without PDL; it only starts sooner. A kernel launched without the
attribute (cuBLAS's GEMMs) waits for the whole stream as usual; one that follows it with PDL
overlaps its own launch with the GEMM's last programs (the GEMM never triggers early, so its
programs' exits do).

`CONFIGS["enabled"]` turns it on or off for every kernel that takes it (the kernels' bits do
not depend on it: only the launch and two instructions at the top change); it is off where
the device is older than sm_90, under the interpreter, and where triton lacks the two
intrinsics (triton < 3.4).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, interpreting, tl, triton

gdc_wait = gdc_launch_dependents = None
if HAS_TRITON:
    try:  # triton >= 3.4: grid dependency control
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - depends on the triton build
        pass

CONFIGS = {"enabled": True}
_CAPABLE: dict = {}  # device index -> compute capability >= 9.0


def available(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (sm_90+, triton's intrinsics, not
    the interpreter); CONFIGS aside."""
    if device.type != "cuda" or gdc_wait is None or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


def on(device: torch.device) -> bool:
    """Whether a launch on `device` uses PDL now: CONFIGS["enabled"] and `available`."""
    return bool(CONFIGS["enabled"]) and available(device)


def launch_kw(device: torch.device) -> dict:
    """The keywords a kernel that takes PDL (a `PDL: tl.constexpr` calling `enter`) is launched
    with: PDL=True and triton's launch_pdl where `on(device)`, else PDL=False."""
    return dict(PDL=True, launch_pdl=True) if on(device) else dict(PDL=False)


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the kernel before (complete, writes visible),
    then let the next one launch (module docstring)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
