"""rlcu.train.rows: where a trainer's rows come from and their order, one implementation for SFT
and RL (the data sources' precedence, the held-out split, the seeded order per epoch)."""

import pytest
import torch

from rlcu.config import DataConfig
from rlcu.train.rl_trainer import PromptSampler
from rlcu.train.rows import EpochOrder, load_rows
from rlcu.train.sft import PackedStream


def _loader(calls):
    def load(source, name, **where):
        calls.append((source, name, where))
        return list(source) if isinstance(source, list) else [f"{source}:{i}" for i in range(10)]
    return load


def test_epoch_order_is_a_function_of_seed_and_epoch():
    o = EpochOrder(50, seed=3)
    first, second = list(o(0)), list(o(1))
    assert sorted(first) == list(range(50)) and first != second and first != list(range(50))
    assert o(0) == first and EpochOrder(50, seed=3)(1) == second  # recomputed, not remembered
    # the order checkpoints were written against: a resumed run reads the rows as before
    want = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1)).tolist()
    assert second == want
    assert EpochOrder(5, seed=3, shuffle=False)(4) == [0, 1, 2, 3, 4]


def test_sft_and_rl_read_rows_in_one_order():
    rows = [{"i": i} for i in range(7)]
    sampler = PromptSampler(rows, seed=5)
    stream = PackedStream([1] * 7, batch_tokens=1, shuffle=True, seed=5)
    by_rl = [r["i"] for r in sampler.next(14)]
    by_sft = [stream.next_batch()[0] for _ in range(14)]
    assert by_rl == by_sft == EpochOrder(7, 5)(0) + EpochOrder(7, 5)(1)


def test_sources_in_order_of_precedence():
    d = DataConfig(path="train.jsonl", eval_path="held.jsonl", eval_size=3)
    calls = []
    rows, held, name = load_rows(d, None, None, _loader(calls), "SFT")
    assert name == "train.jsonl" and len(rows) == 10 and held[0] == "held.jsonl:0"
    assert calls[0][2]["field"] == "data.path" and calls[1][2] == dict(split="test", subset=None,
                                                                      field="data.eval_path")
    calls.clear()  # rows passed in win over the config's, and their errors name no option
    rows, held, name = load_rows(d, ["a", "b"], ["c"], _loader(calls), "SFT")
    assert (rows, held, name) == (["a", "b"], ["c"], "dataset")
    assert [(c[1], c[2]["field"]) for c in calls] == [("dataset", None), ("eval_dataset", None)]


def test_held_out_rows_split_off_without_an_eval_source():
    d = DataConfig(path="train.jsonl", eval_size=3, seed=1)
    rows, held, _ = load_rows(d, None, None, _loader([]), "GRPO")
    assert len(rows) == 7 and len(held) == 3 and sorted(rows + held) == sorted(f"train.jsonl:{i}" for i in range(10))
    assert load_rows(d, None, None, _loader([]), "GRPO")[1] == held  # seeded
    with pytest.raises(ValueError, match=r"data.eval_size \(3\) must be smaller than the 2 rows of dataset"):
        load_rows(d, ["a", "b"], None, _loader([]), "GRPO")


def test_no_data_names_the_trainer():
    with pytest.raises(ValueError, match="PPO needs data: pass dataset= or set data.path"):
        load_rows(DataConfig(), None, None, _loader([]), "PPO")
