"""bench/lora_kernel.py on the CPU (the twin): a row per module and layout with its bound, the
timings of rlcu and its peers, and errors of the update that say the three compute one thing."""

import pytest

bench = pytest.importorskip("bench.lora_kernel")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("layout", ["grouped", "random"])
def test_bench_row(layout):
    K, widths = bench.TINY["qkv"]
    row = bench.run("qkv", K, widths, 9, 3, 8, layout, cuda=False)
    assert row["N"] == sum(widths) and row["slices"] == 3 and row["bound_us"] > 0
    assert {"rlcu_us", "loop_us", "bmm_us"} <= set(row) and ("rlcu_order_us" in row) == (layout == "random")
    assert row["rlcu_rel_err"] < 1e-2 and row["loop_rel_err"] < 1e-2
