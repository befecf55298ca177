"""bench/reward_model.py's rlcu side on the CPU (a tiny model): every step takes the protocol's pairs,
the row carries the throughput figures the JSON reports, and the pairs hold no pad id (0), so TRL's
collator pads nothing. (`python bench/reward_model.py --tiny` runs TRL's side too, in its own
process: ~1 min, mostly importing TRL, so not here.)"""

import pytest

bench = pytest.importorskip("bench.reward_model")


@pytest.mark.usefixtures("one_thread")
def test_bench_rlcu_row():
    p = bench.TINY_PROTOCOL
    row = bench.bench_rlcu("tiny", p, steps=2, warmup=1, tiny=True)
    assert len(row["steps"]) == 2 and row["s_per_step"] > 0
    assert row["tokens_per_step"] == p["pairs"] * (2 * p["prompt_len"] + p["chosen_len"] + p["rejected_len"])
    assert row["pairs_per_s"] == pytest.approx(p["pairs"] / row["s_per_step"])
    pairs = bench._pairs(512, 3, p)
    assert all(len(c) == p["prompt_len"] + p["chosen_len"] and c[: p["prompt_len"]] == r[: p["prompt_len"]]
               and 0 not in c + r for c, r in pairs)
