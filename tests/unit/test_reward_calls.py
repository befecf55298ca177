"""Reward functions called as TRL's GRPOTrainer calls them (chat completions as assistant
messages, completion_ids, trainer_state, log_metric, every dataset column; narrower
signatures get only what they name), and user modules found beside the config and in the
working directory without PYTHONPATH."""

import re
import sys

import pytest

from rlcu.rewards import RewardSet, TrainerState, add_import_dir, load_reward
from rlcu.rewards import loader as reward_loader

CHAT = [{"role": "user", "content": "What is 2+2?"}]


# written for TRL, unchanged: completions[i][0]["content"], a dataset column, **kwargs
def think_format_reward(completions, **kwargs):
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    return [1.0 if re.match(pattern, c[0]["content"], re.DOTALL | re.MULTILINE) else 0.0 for c in completions]


def accuracy_reward(completions, solution, log_extra=None, **kwargs):
    out = [1.0 if sol in c[0]["content"] else 0.0 for c, sol in zip(completions, solution)]
    if log_extra is not None:
        log_extra("solution", list(solution))
    return out


seen = {}


def full_signature(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
    seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                trainer_state=trainer_state, kwargs=kwargs)
    log_metric("mean_ids", sum(len(c) for c in completion_ids) / len(completion_ids))
    return [float(trainer_state.global_step)] * len(completions)


def narrow(completions, solution):  # no **kwargs: gets only what it names
    return [float(len(s)) for s in solution]


def legacy(ps, cs):  # the older rlcu convention, positional under other names
    return [float(len(c)) for c in cs]


async def async_reward(completions, **kwargs):
    return [0.5] * len(completions)


def test_trl_shaped_call():
    rs = RewardSet([think_format_reward, accuracy_reward, full_signature, narrow, legacy, async_reward])
    prompts = [CHAT, CHAT, "a plain prompt"]
    comps = ["<think>2+2</think> 4", "5", "<think>x</think> 4"]
    rows = [{"prompt": CHAT, "solution": "4", "level": 1}, {"prompt": CHAT, "solution": "4", "level": 2},
            {"prompt": "a plain prompt", "solution": "44", "level": 3}]
    state = TrainerState(global_step=7, max_steps=10, epoch=0.5)
    _, parts, errors = rs(prompts, comps, rows, completion_ids=[[1, 2], [3], [4, 5, 6]], trainer_state=state)
    assert len(errors) == 2 and all("failed on 1 of 3 samples" in e and "#2" in e for e in errors)
    # the plain prompt's completion is a string: TRL's functions index it as a message and fail on it alone
    assert parts["think_format_reward"][:2].tolist() == [1.0, 0.0]
    assert parts["accuracy_reward"][:2].tolist() == [1.0, 0.0]
    assert parts["narrow"].tolist() == [1.0, 1.0, 2.0]
    assert parts["legacy"].tolist() == [1.0, 1.0, float(len(comps[2]))]  # one message, one message, a text
    assert parts["async_reward"].tolist() == [0.5] * 3
    assert parts["full_signature"].tolist() == [7.0] * 3
    assert seen["prompts"] == prompts
    assert seen["completions"][:2] == [[{"role": "assistant", "content": c}] for c in comps[:2]]
    assert seen["completions"][2] == comps[2]
    assert seen["completion_ids"] == [[1, 2], [3], [4, 5, 6]]
    assert seen["trainer_state"] is state
    assert seen["kwargs"]["solution"] == ["4", "4", "44"] and seen["kwargs"]["level"] == [1, 2, 3]
    assert "prompt" not in seen["kwargs"] and "log_extra" in seen["kwargs"]
    assert rs.last_metrics["rewards/mean_ids"] == 2.0
    assert rs.last_extra["accuracy_reward"]["solution"] == ["4", "4"]  # from the one-sample retries that worked


def test_missing_column_is_named():
    _, _, errors = RewardSet([narrow])(["p"], ["c"], [{"answer": "1"}])
    assert "needs argument(s) 'solution', which neither the rows (columns: answer) nor its kwargs give" in errors[0]


def test_kwargs_win_over_columns_and_are_not_split():
    def f(completions, pattern, tags, **kw):
        return [float(len(tags)) if pattern else 0.0 for _ in completions]

    rs = RewardSet([{"fn": f, "kwargs": {"pattern": "x", "tags": ["a", "b", "c"]}}])
    total, _, errors = rs(["p", "q"], ["c", "d"], [{"pattern": None}, {"pattern": None}])
    assert errors == [] and total.tolist() == [3.0, 3.0]


def test_reward_module_beside_the_config(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "exp"
    cfg_dir.mkdir()
    (cfg_dir / "beside_cfg_rewards.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    (cfg_dir / "grpo.yaml").write_text("steps: 1\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "in_cwd_rewards.py").write_text("def r(completions, **kw):\n    return [2.0] * len(completions)\n")
    (work / "broken_rewards.py").write_text("def r(:\n")
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(work))])
    monkeypatch.setattr(reward_loader, "_DIRS", [])
    try:
        with pytest.raises(ValueError, match=r"cannot import module 'beside_cfg_rewards'.*looked in .*work "
                                             r"\(the working directory\)"):
            load_reward("beside_cfg_rewards:r")
        add_import_dir(cfg_dir / "grpo.yaml")
        assert load_reward("beside_cfg_rewards:r")(completions=["a"]) == [1.0]
        assert load_reward("in_cwd_rewards:r")(completions=["a"]) == [2.0]
        with pytest.raises(ValueError, match=r"importing module 'broken_rewards' raised SyntaxError"):
            load_reward("broken_rewards:r")
    finally:
        for m in ("beside_cfg_rewards", "in_cwd_rewards", "broken_rewards"):
            sys.modules.pop(m, None)


def test_trl_reward_functions_unchanged():
    """TRL's own reward functions (when trl and math-verify are installed), through the
    default main-thread runner with a time limit."""
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    rs = RewardSet([trl_rewards.think_format_reward, trl_rewards.accuracy_reward], timeout_s=60)
    comps = ["<think>2+2 is 4</think> The answer is $\\boxed{4}$", "no think, $\\boxed{5}$"]
    total, parts, errors = rs([CHAT, CHAT], comps, [{"prompt": CHAT, "solution": "$4$"}] * 2)
    assert errors == []
    assert parts["think_format_reward"].tolist() == [1.0, 0.0]
    assert parts["accuracy_reward"].tolist() == [1.0, 0.0]
    assert total.tolist() == [2.0, 0.0]
    assert rs.last_extra["accuracy_reward"]["solution"] == ["$4$", "$4$"]
