"""GRPO's / PPO's evaluation: eval/accuracy is the fraction of held-out prompts whose total reward
is > 0, and each reward function's own mean is logged beside it (eval/reward/NAME), so that a
format bonus beside exact match, which makes every total positive, does not hide exact match's
own score."""

import pytest
from support.trainers import grpo_config

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _trainer(tmp_path, rewards, held):
    from rlcu.train.grpo import GRPOTrainer

    cfg, tok = grpo_config(tmp_path)
    return GRPOTrainer(cfg, syn.sort_rows(8, "train", min_len=2, max_len=3), rewards, tokenizer=tok,
                       eval_dataset=held)


def bonus(prompts, completions, **_):
    return [0.1] * len(completions)


def half_none(prompts, completions, answer, **_):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def test_eval_logs_each_reward_function_and_accuracy_is_a_positive_total(tmp_path):
    held = syn.sort_rows(6, "eval", min_len=2, max_len=3)
    tr = _trainer(tmp_path, ["rlcu.data.synthetic:exact_match_reward", "test_rl_eval:bonus",
                             "test_rl_eval:half_none"], held)
    ev = tr.evaluate()
    assert ev["eval/reward/exact_match_reward"] == 0.0  # an untrained model sorts nothing
    assert ev["eval/reward/bonus"] == pytest.approx(0.1) and ev["eval/reward/half_none"] == 1.0
    assert ev["eval/accuracy"] == 1.0  # every total is > 0: the bonus alone
    assert ev["eval/reward"] == pytest.approx((3 * 1.1 + 3 * 0.1) / 6)


def test_eval_with_one_function_logs_it_too(tmp_path):
    held = syn.sort_rows(4, "eval", min_len=2, max_len=3)
    ev = _trainer(tmp_path, None, held).evaluate()
    assert ev["eval/reward/exact_match_reward"] == ev["eval/reward"] == ev["eval/accuracy"] == 0.0
