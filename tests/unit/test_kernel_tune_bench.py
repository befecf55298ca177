"""bench/kernel_tune.py's sweep on plain functions (its kernels' run is `--quick`, too slow for
CI): the current config first and the reference of every candidate's outputs; a candidate whose
bits differ dropped untimed where bits are required, kept within 1e-2 where not; a failing
candidate recorded; the rest of the list skipped past the case's deadline; the fastest eligible
the winner."""

import contextlib
import time

import pytest
import torch

kt = pytest.importorskip("bench.kernel_tune")


def _case(exact, deadline):
    x = torch.arange(1.0, 9.0)
    cfg = {}
    scale = {2: 1.0, 3: 1.0, 4: 1.001, 5: 1.5}
    nap = {2: 0.03, 3: 0.001, 4: 0.0, 5: 0.0}

    @contextlib.contextmanager
    def apply(c):
        if c == 6:
            raise RuntimeError("out of resources: shared memory")
        cfg["c"] = c
        yield

    def outputs():
        time.sleep(nap[cfg["c"]])
        return [x * scale[cfg["c"]]]

    return kt.sweep("toy", "here", 2, [3, 4, 5, 6, 2], apply, outputs, None, exact, deadline, cuda=False)


def test_sweep_keeps_bits_and_budget():
    rec = _case(True, time.perf_counter() + 60)
    rows = {r["config"]: r for r in rec["candidates"]}
    assert [r["config"] for r in rec["candidates"]] == [2, 3, 4, 5, 6]  # the current once, first
    assert rows[3]["bit_equal"] and "us" in rows[3]
    assert rows[4]["skipped"] == rows[5]["skipped"] == "bits differ" and "us" not in rows[4]
    assert rows[6]["error"].startswith("RuntimeError: out of resources")
    assert rec["best"]["config"] == 3 and rec["speedup"] > 1
    loose = {r["config"]: r for r in _case(False, time.perf_counter() + 60)["candidates"]}
    assert "us" in loose[4] and not loose[4]["bit_equal"] and loose[5]["skipped"] == "error above 1e-2"
    late = _case(True, time.perf_counter() - 1)
    assert "us" in late["current"] and all(r["skipped"] == "budget" for r in late["candidates"][1:])
    assert late["best"]["config"] == 2
