"""ops/_backend.py: `dispatch`, the one place an op picks its Triton kernel or its twin, and
the stand-in for triton where it cannot be imported."""

import pytest
import torch

from rlcu.ops import _backend
from rlcu.ops._backend import _Absent, dispatch
from rlcu.ops.rmsnorm import rmsnorm_fwd, rmsnorm_fwd_ref


def _op():
    calls = []

    def kernel(x, y, scale=None, out=None):
        calls.append(("kernel", x, y, scale, out))
        return "k"

    def twin(x, y, scale=None, out=None):
        calls.append(("twin", x, y, scale, out))
        return "t"

    @dispatch(kernel, twin, on="x")
    def op(x, y, scale=2.0, out=None):
        """the public op"""
        if y < 0:
            raise ValueError("y must be >= 0")

    return op, calls


def test_dispatch_follows_the_backend(monkeypatch):
    op, calls = _op()
    x = torch.zeros(1)
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    assert op(x, 1) == "t" and calls[-1] == ("twin", x, 1, 2.0, None)  # the public defaults, not the twin's
    assert op(x, 1, out=5) == "t" and calls[-1] == ("twin", x, 1, 2.0, 5)  # keywords: positional, in order
    assert op(y=1, x=x) == "t" and calls[-1] == ("twin", x, 1, 2.0, None)
    monkeypatch.delenv("RLCU_BACKEND")
    assert op(x, 1) == "t"  # a CPU tensor takes the twin
    if _backend.HAS_TRITON:
        monkeypatch.setenv("RLCU_BACKEND", "triton")
        assert op(x, 1, 3.0) == "k" and calls[-1] == ("kernel", x, 1, 3.0, None)
    with pytest.raises(ValueError, match="y must be"):  # the body's checks run first
        op(x, -1)
    with pytest.raises(TypeError):
        op(x)
    assert op.__doc__ == "the public op" and op.twin is not None and op.__name__ == "op"


def test_dispatch_rejects_bad_declarations():
    with pytest.raises(TypeError, match="no argument 'z'"):
        dispatch(print, print, on="z")(lambda x: None)
    with pytest.raises(TypeError, match="positional parameters only"):
        dispatch(print, print, on="x")(lambda x, *, y=1: None)


def test_an_op_uses_its_twin_on_cpu():
    x, w = torch.randn(3, 8), torch.randn(8)
    y, rstd = rmsnorm_fwd(x, w, 1e-6)
    y0, rstd0 = rmsnorm_fwd_ref(x, w, 1e-6)
    assert torch.equal(y, y0) and torch.equal(rstd, rstd0)
    assert rmsnorm_fwd.twin is rmsnorm_fwd_ref


def test_absent_triton_defines_kernels_and_refuses_launches():
    triton, tl = _Absent("triton"), _Absent("triton.language")

    @triton.jit(do_not_specialize=["N"])
    def kernel(X, N, BLOCK: tl.constexpr):
        pass

    @triton.jit
    def helper(x):
        return x

    const = tl.constexpr(1.5)
    for k in (kernel, helper):
        with pytest.raises(RuntimeError, match="triton package cannot be imported"):
            k[(1,)](0, 1, BLOCK=4)
    with pytest.raises(RuntimeError, match="triton.cdiv"):
        int(triton.cdiv(3, 2))  # a launch-time helper used as a number
    with pytest.raises(RuntimeError):
        bool(const)
