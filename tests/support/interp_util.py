"""Whether the CPU tests can run a Triton kernel: on a machine without CUDA only when Triton is
installed and the kernel was decorated under TRITON_INTERPRET=1 (Triton decides at decoration
time, so the variable must precede its first import); with CUDA whenever Triton is installed."""

import pytest
import torch

from rlcu.ops._backend import HAS_TRITON


def kernels_runnable(kernel) -> bool:
    if HAS_TRITON and not torch.cuda.is_available():
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(kernel, InterpretedFunction)
    return HAS_TRITON


def needs_triton(kernel):
    """A skip mark for tests that run `kernel`'s module's kernels."""
    return pytest.mark.skipif(not kernels_runnable(kernel), reason="no triton, or not interpreted on the CPU")
