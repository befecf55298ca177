"""`RLCU_BACKEND=triton TRITON_INTERPRET=1` outside pytest: the library itself applies the
interpreter's numpy >= 2.4 fix (a fresh process, so conftest's import-time setup is absent)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SRC = str(Path(__file__).resolve().parents[2] / "src")

# rmsnorm's backward loops over a runtime bound (tiles per program): the interpreter's int()
# of a 1-element array, which numpy >= 2.4 refuses without the fix
SCRIPT = """
import torch
from rlcu.ops import rmsnorm as r
torch.manual_seed(0)
x, w, dy = torch.randn(7, 96), torch.randn(96), torch.randn(7, 96)
y, rstd = r.rmsnorm_fwd(x, w, 1e-6)
dx, dw = r.rmsnorm_bwd(dy, x, w, rstd)
y0, rstd0 = r.rmsnorm_fwd_ref(x, w, 1e-6)
dx0, dw0 = r.rmsnorm_bwd_ref(dy, x, w, rstd0)
err = max(float((a - b).norm() / b.norm()) for a, b in ((y, y0), (dx, dx0), (dw, dw0)))
assert err < 1e-5, err
print("ok", err)
"""


def test_interpreter_outside_pytest():
    env = {**os.environ, "RLCU_BACKEND": "triton", "TRITON_INTERPRET": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("ok")


def test_patch_is_idempotent():
    from rlcu.ops._backend import patch_triton_interpreter

    first = patch_triton_interpreter()
    assert patch_triton_interpreter() == first
    import numpy as np

    try:
        int(np.array([1]))
        needs = False
    except TypeError:
        needs = True
    assert first == needs
