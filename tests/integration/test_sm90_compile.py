"""Every Triton kernel of rlcu.ops compiles for the H200 (sm_90) as its launcher launches it,
on the CI machine, which has no GPU (tests/support/sm90_launches.py: the launchers' own GPU tiles, the
JIT's own argument specialisation, Triton's ptxas). The interpreter runs the kernels' math but
never lowers them: a tile that needs more shared memory than an SM has, a construct without a
GPU lowering, a launch option the backend refuses, registers spilled to local memory would
otherwise first show on the device. The decode GEMM's code is read too: pipelined loads, warpgroup
MMAs and its PDL wait."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMEM_MAX = 227 * 1024  # the H200's shared memory a block may opt in to


def _kernels_defined() -> set[str]:
    """module.name of every @triton.jit function named *_kernel in src/rlcu/ops (the launch
    targets; the helpers they call are compiled inside them)."""
    out = set()
    for f in sorted((ROOT / "src/rlcu/ops").glob("*.py")):
        for m in re.finditer(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", f.read_text()):
            out.add(f"rlcu.ops.{f.stem}.{m.group(1)}")
    return out


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLCU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(ROOT / "tests/support/sm90_launches.py")], capture_output=True, text=True,
                       env=env, timeout=900)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert not got["call_errors"], got["call_errors"]
    errors = {k: [e["error"] for e in v if "error" in e] for k, v in got["kernels"].items()}
    assert not any(errors.values()), {k: e for k, e in errors.items() if e}
    missing = _kernels_defined() - set(got["kernels"])
    assert not missing, f"kernels no launch in tests/support/sm90_launches.py reaches: {sorted(missing)}"
    big = {k: e["shared"] for k, v in got["kernels"].items() for e in v if e["shared"] > SMEM_MAX}
    assert not big, big
    # no variant spills registers to local memory (every kernel is spill-free at the launchers' tiles)
    assert all("spills" in e for v in got["kernels"].values() for e in v), "ptxas -v gave no register report"
    spills = {k: [e["spills"] for e in v] for k, v in got["kernels"].items() if any(e.get("spills") for e in v)}
    assert not spills, spills


def test_gpu_code_pipelines_and_waits_under_pdl():
    # tests/support/sm90_launches.py compiles ops/decode_linear.py as its launcher launches it (the
    # test above checks that it compiles at all); here: the weight loads are pipelined (cp.async), the
    # 64-row tiles use warpgroup MMAs, and PDL compiles the grid-dependency wait in
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLCU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(ROOT / "tests/support/sm90_launches.py"), "decode_linear"],
                       capture_output=True,
                       text=True, env=env, timeout=600)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])["kernels"]["rlcu.ops.decode_linear._linear_kernel"]
    assert all(e["cp_async"] for e in got)
    assert any(e["wgmma"] for e in got)
    assert [e["griddepcontrol"] for e in got].count(True) == 1  # the one PDL launch waits
    assert [e["launch_dependents"] for e in got] == [e["griddepcontrol"] for e in got]  # and lets the next start


def test_lora_expand_rounds_as_its_twin():
    """ops/lora.py's expand multiplies by the adapter's scale with mul.rn and has no fp32 FMA, so
    that ptxas never contracts the product with the add into y (the twin rounds both); its
    prefill tiles use warpgroup MMAs, as shrink's do."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLCU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(ROOT / "tests/support/sm90_launches.py"), "lora"], capture_output=True,
                       text=True, env=env, timeout=600)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert not got["call_errors"], got["call_errors"]
    expand = got["kernels"]["rlcu.ops.lora._expand_kernel"]
    assert all(e["mul_rn"] and not e["fma_f32"] for e in expand), expand
    assert any(e["wgmma"] for e in expand) and any(e["wgmma"] for e in got["kernels"]["rlcu.ops.lora._shrink_kernel"])
