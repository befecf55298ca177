"""Which implementation an op runs: the Triton kernel or the PyTorch reference twin.

`RLCU_BACKEND=torch|triton` forces one; unset, CUDA tensors take Triton and everything
else takes the twin. `RLCU_BACKEND=triton` with `TRITON_INTERPRET=1` runs the kernels on
CPU tensors through Triton's interpreter (slow, for tests). Importing this module with
the interpreter on applies `patch_triton_interpreter` (numpy >= 2.4, see there), so that mode
works in any process, not only under pytest.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

import torch


class _Absent:
    """Stands for the triton package (or one of its names) where it cannot be imported, so that
    an op file's kernels still *define*: decorators (`@triton.jit(...)`), `tl.constexpr`
    annotations and module-level `tl.constexpr(x)` evaluate to more `_Absent`s. Launching a
    kernel (`kernel[grid](...)`) or using one as a number raises; the twins never do either
    (`use_triton` is False without triton)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kw):
        return _Absent(f"{self._name}(...)")

    def _missing(self, *_):
        raise RuntimeError(f"{self._name}: the triton package cannot be imported here, so no Triton kernel can "
                           "run (the ops run their PyTorch twins unless RLCU_BACKEND=triton)")

    __getitem__ = __bool__ = __index__ = __int__ = __float__ = __iter__ = _missing


try:  # triton ships with CUDA torch; on a CPU-only machine it is optional
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    HAS_TRITON = False
    triton, tl = _Absent("triton"), _Absent("triton.language")
try:
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - depends on the triton build
    libdevice = _Absent("triton.language.extra.libdevice")

__all__ = ["HAS_TRITON", "backend_name", "compiled_variants", "dispatch", "interpreting", "libdevice", "tl", "triton",
           "use_triton"]

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


def dispatch(kernel: Callable, twin: Callable, on: str) -> Callable:
    """Decorator of an op's public function, the one place an op picks its backend: the
    decorated body checks the arguments (or is only a docstring); then the op returns
    `kernel(*args)` when `use_triton(<argument named on>)`, else `twin(*args)`, args being
    every argument of the public function in its order (defaults filled in), positionally.
    Arguments given by keyword (`exact=`) cost no `Signature.bind`: the call of the public
    function has checked them already."""

    def wrap(public: Callable) -> Callable:
        sig = inspect.signature(public)
        params = list(sig.parameters.values())
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            raise TypeError(f"dispatch: {public.__qualname__} must take positional parameters only")
        names = [p.name for p in params]
        if on not in names:
            raise TypeError(f"dispatch(on={on!r}): {public.__qualname__} has no argument {on!r}")
        i, n, defaults = names.index(on), len(params), tuple(p.default for p in params)

        @functools.wraps(public)
        def op(*args, **kw):
            public(*args, **kw)  # a wrong call raises here, as a plain function's would
            if len(args) < n:  # the rest by keyword, else by default
                rest = zip(names[len(args):], defaults[len(args):])
                args += tuple(kw.get(k, d) for k, d in rest) if kw else defaults[len(args):]
            return (kernel if use_triton(args[i]) else twin)(*args)

        op.kernel, op.twin = kernel, twin
        return op

    return wrap


def compiled_variants(prefix: str = "rlcu.ops") -> dict[str, int]:
    """Compiled variants of every Triton kernel defined in the loaded modules under `prefix`,
    by "module.kernel" (the JIT's in-memory caches, one entry a signature, filled by a compile
    or by a load from Triton's disk cache): a diagnostic of what a run compiled, for tests and
    benchmarks."""
    if not HAS_TRITON:
        return {}
    import sys

    from triton.runtime.jit import JITFunction

    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for attr, fn in list(vars(mod).items()):
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None)
                if caches is not None:  # triton >= 3.2: device -> (kernel cache, ...)
                    n = sum(len(c[0]) for c in list(caches.values()))
                else:  # older: device -> kernel cache
                    n = sum(len(c) for c in getattr(fn, "cache", {}).values())
                out[f"{name}.{attr}"] = n
    return out


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def patch_triton_interpreter() -> bool:
    """Make Triton's interpreter work with numpy >= 2.4; True when the patch is (now) applied.

    The interpreter holds a scalar as a 1-element numpy array and converts it with `int()` where
    Python wants an index (a `range` over a runtime loop bound); numpy 2.4 refuses `int()` of an
    array that is not 0-dimensional ("only 0-dimensional arrays can be converted to Python
    scalars"). The patch gives the interpreter's tensors an `__index__` through `.item()`, which
    takes both shapes. It does nothing when numpy still converts such arrays, when triton (or its
    interpreter) is missing, or when it is already applied. Safe to call more than once.
    """
    if not HAS_TRITON:
        return False
    try:
        import numpy as np
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - depends on the triton build
        return False
    if getattr(interp._patch_lang_tensor, "_rlcu_scalar_index", False):
        return True
    try:
        int(np.array([1]))
        return False  # numpy < 2.4 converts 1-element arrays: nothing to fix
    except TypeError:
        pass
    patch_tensor = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _patch_lang_tensor._rlcu_scalar_index = True
    interp._patch_lang_tensor = _patch_lang_tensor
    return True


if interpreting():
    patch_triton_interpreter()
