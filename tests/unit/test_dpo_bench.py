"""bench/dpo.py's rlcu side on the CPU (a tiny model): every step takes the protocol's pairs, and
the row carries the throughput and reference-pass figures the JSON reports. (`python bench/dpo.py
--tiny` runs TRL's side too, in its own process: ~1 min, mostly importing TRL, so not here.)"""

import pytest

bench = pytest.importorskip("bench.dpo")


@pytest.mark.usefixtures("one_thread")
def test_bench_rlcu_row():
    p = bench.TINY_PROTOCOL
    row = bench.bench_rlcu("tiny", p, steps=2, warmup=1, tiny=True)
    assert len(row["steps"]) == 2 and row["s_per_step"] > 0 and row["ref_s"] > 0
    assert row["tokens_per_step"] == p["pairs"] * (2 * p["prompt_len"] + p["chosen_len"] + p["rejected_len"])
    assert row["pairs_per_s"] == pytest.approx(p["pairs"] / row["s_per_step"])
    pairs = bench._pairs(512, 3, p)
    assert all(c[-1] == r[-1] == 511 and 511 not in a + c[:-1] for a, c, r in pairs)  # <eos> ends completions only
