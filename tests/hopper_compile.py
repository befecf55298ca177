"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU: the wheel's own
ptxas, the argument specialisation a JIT launch gives (16-byte aligned pointers, the named
ints divisible by 16). It catches what the interpreter cannot: code that does not lower to
the GPU (inline PTX, grid dependency control, tile shapes), loops that lose their pipelining.

The kernels are compiled in a subprocess without TRITON_INTERPRET (under it, triton.jit gives
interpreted functions, which do not compile): `compile_sm90(specs)` runs this file with the
specs as JSON on stdin, and it prints one summary per spec."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MARKS = {"cp.async": "cp.async", "wgmma": "wgmma", "griddepcontrol": "griddepcontrol.wait",
         "prefetch": "prefetch.global.L2"}


def compile_sm90(specs: list[dict], timeout: float = 300) -> list[dict]:
    """specs: {"kernel": "module:name", "signature": {arg: type}, "constexprs": {...}, "div16": [...],
    "options": {num_warps, num_stages, launch_pdl, ...}} -> per spec {"shared": bytes, mark: bool}
    for the PTX marks in MARKS. Skips the test where triton or its sm_90 compiler is missing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, __file__], input=json.dumps(specs), capture_output=True, text=True, env=env,
                       timeout=timeout)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _main() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"triton cannot be imported here: {e}")
        return 3
    out = []
    for s in json.loads(sys.stdin.read()):
        mod, name = s["kernel"].split(":")
        fn = getattr(importlib.import_module(mod), name)
        consts = s["constexprs"]
        sig = {**s["signature"], **{k: "constexpr" for k in consts}}
        idx = fn.arg_names.index
        aligned = [k for k, v in s["signature"].items() if v.startswith("*")] + list(s.get("div16", ()))
        src = ASTSource(fn, sig, constexprs={(idx(k),): v for k, v in consts.items()},
                        attrs={(idx(k),): [["tt.divisibility", 16]] for k in aligned})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=s.get("options", {}))
        except RuntimeError as e:
            if "ptxas" in str(e).lower():
                print(f"no sm_90 compiler here: {str(e)[:200]}")
                return 3
            raise
        ptx = k.asm["ptx"]
        out.append({"shared": k.metadata.shared, **{m: pat in ptx for m, pat in MARKS.items()}})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
