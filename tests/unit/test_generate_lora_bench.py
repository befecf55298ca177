"""bench/generate_lora.py --quick on the CPU: the protocol with no adapters, one adapter, N round
robin and an engine without LoRA slots, each case's tokens/s and the overhead against the last."""

import pytest

bench = pytest.importorskip("bench.generate_lora")


@pytest.mark.usefixtures("one_thread")
def test_quick_run(monkeypatch):
    got = {}
    monkeypatch.setattr(bench, "write_json", lambda name, payload: got.update(name=name, **payload) or name)
    assert bench.main(["--quick", "--lora", "3", "--lora-rank", "4"]) == 0
    assert got["name"] == "generate_lora_quick.json" and got["config"]["adapters"] == 3
    cases = got["cases"]
    assert len(cases) == 4 and all(c["output_tokens"] > 0 and c["tok_per_s"] > 0 for c in cases)
    assert len({c["output_tokens"] for c in cases}) == 1  # the same requests in every case
    assert all("overhead_vs_no_lora" in c for c in cases[:3]) and "overhead_vs_no_lora" not in cases[3]
