"""bench/moe_kernel.py on the CPU (the twins): a decode row and a training row with their bound or
MFU, rlcu's timings and the loop peer's, and an error that says the two compute one thing."""

import pytest
import torch

bench = pytest.importorskip("bench.moe_kernel")


@pytest.mark.usefixtures("one_thread")
def test_bench_rows():
    g = torch.Generator().manual_seed(0)
    wgu, wd = bench.weights(bench.TINY, "cpu", g)
    row = bench.decode_row(bench.TINY, 5, wgu, wd, False, g)
    assert 1 <= row["experts_touched"] <= 8 and row["bound_us"] > 0
    assert {"rlcu_us", "rlcu_experts_us", "loop_us", "fraction_of_bound"} <= set(row) and row["rel_err"] < 1e-2
    row = bench.train_row(bench.TINY, 24, wgu, wd, False, g)
    assert {"fwd_us", "bwd_us", "fwd_mfu", "bwd_mfu", "step_mfu", "loop_fwd_us", "loop_fwd_bwd_us"} <= set(row)
    assert row["rel_err"] < 1e-2
