"""Rewards: answer extraction and comparison, format, user functions by 'module:function',
weights, None masking, and exceptions caught, reported with the sample, and masked."""

import math
import sys

import pytest
import torch

from rlcu.rewards import (
    RewardSet,
    answers_match,
    extract_answer,
    format_reward,
    load_reward,
    math_reward,
    normalize_answer,
)


@pytest.mark.parametrize("text, want", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{x^{2}+1}", "x^{2}+1"),
    ("\\fbox{7}", "7"),
    ("work...\nAnswer: 12 apples\nthanks", "12 apples"),
    ("answer: 3\nAnswer: 5", "5"),
    ("no answer here", None),
    ("\\boxed{unclosed", None),
])
def test_extract(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("a, b, same", [
    ("\\frac{1}{2}", "0.5", True), ("\\dfrac{3}{4}", "3/4", True), ("1,000", "1000", True),
    ("$5$", "5", True), ("5.", "5", True), ("\\text{yes}", "Yes", True), ("0.3333333", "1/3", False),
    ("2", "3", False), ("x+1", "x + 1", True), ("1e3", "1000", True), ("-2", "-2.0", True),
    ("\\left(1,2\\right)", "(1,2)", True),
])
def test_match(a, b, same):
    assert answers_match(a, b) is same, (normalize_answer(a), normalize_answer(b))


def test_math_and_format():
    comps = ["\\boxed{4}", "Answer: 5", "I don't know", "<think>hmm</think> \\boxed{4}", "\\boxed{4} \\boxed{4}"]
    rows_answer = ["4", "4", "4", None, "4"]
    assert math_reward([""] * 5, comps, answer=rows_answer) == [1.0, 0.0, 0.0, None, 1.0]
    assert math_reward([""] * 2, comps[:2]) == [None, None]  # no answer field at all
    assert math_reward([""], ["\\boxed{4}"], answer_field="gold", gold=["4"]) == [1.0]
    assert math_reward([""], [[{"role": "assistant", "content": "Answer: 4"}]], answer=["4"]) == [1.0]
    assert format_reward([""] * 5, comps) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert format_reward([""] * 2, ["\\boxed{1}", "<think>a</think>\\boxed{1}"], require_think=True) == [0.0, 1.0]
    assert format_reward([""] * 2, ["<think>\\boxed{1}</think>", "<think>x \\boxed{1}"]) == [0.0, 0.0]
    assert format_reward([""] * 2, ["ok!", "no"], pattern=r"!$") == [1.0, 0.0]


_MOD = '''
calls = []
def length(prompts, completions, **kw):
    calls.append(kw)
    return [float(len(c)) for c in completions]
def picky(prompts, completions, keep, **kw):
    return [1.0 if k else None for k in keep]
def boom(prompts, completions, **kw):
    raise ZeroDivisionError("no luck")
def short(prompts, completions, **kw):
    return [1.0]
def word(prompts, completions, **kw):
    return ["high"] * len(completions)
not_callable = 3
'''


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_load_reward(user_mod):
    assert load_reward("math") is math_reward
    assert load_reward("my_rewards:length")([""], ["abc"]) == [3.0]
    for spec, msg in [("nope", "expected a built-in"), ("no_such_mod_xyz:f", "cannot import module"),
                      ("my_rewards:missing", "has no attribute"), ("my_rewards:not_callable", "not callable")]:
        with pytest.raises(ValueError, match=msg):
            load_reward(spec)


def test_reward_set(user_mod):
    import my_rewards

    rs = RewardSet([{"name": "my_rewards:length", "weight": 0.5}, {"name": "picky", "fn": my_rewards.picky},
                    {"name": "math", "weight": 2.0}])
    assert rs.names == ["length", "picky", "math"]
    prompts = ["p0", "p1", "p2"]
    comps = ["\\boxed{1}", "\\boxed{2}", "xx"]
    rows = [{"prompt": "p0", "answer": "1", "keep": True}, {"prompt": "p1", "answer": "1", "keep": True},
            {"prompt": "p2", "answer": "1", "keep": False}]
    total, parts, errors = rs(prompts, comps, rows)
    assert errors == []
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert total[:2].tolist() == [0.5 * 9 + 1 + 2, 0.5 * 9 + 1 + 0]
    # picky returned None: it does not apply (TRL's convention), the others' weighted sum counts
    assert total[2].item() == 0.5 * 2 + 2 * 0.0
    assert parts["length"].tolist() == [9.0, 9.0, 2.0] and math.isnan(parts["picky"][2])
    kw = my_rewards.calls[-1]
    assert kw["answer"] == ["1", "1", "1"] and kw["keep"] == [True, True, False]  # row fields, as lists
    # a sample that no function scores is masked
    total, _, errors = RewardSet([my_rewards.picky])(["a", "b"], ["x", "y"], [{"keep": True}, {"keep": False}])
    assert total[0] == 1.0 and math.isnan(total[1]) and errors == []


def test_reward_errors_are_masked(user_mod):
    seen = []
    rs = RewardSet(["my_rewards:length", "my_rewards:boom", "my_rewards:short", "my_rewards:word"],
                   on_error=seen.append)
    total, parts, errors = rs(["the prompt", "q"], ["the completion", "c"], [{}, {}])
    assert torch.isnan(total).all()
    assert parts["length"].tolist() == [14.0, 1.0]
    assert torch.isnan(parts["boom"]).all() and torch.isnan(parts["short"]).all() and torch.isnan(parts["word"]).all()
    assert len(errors) == 3 and seen == errors
    assert "reward 'boom' failed on 2 of 2 samples" in errors[0] and "ZeroDivisionError: no luck" in errors[0]
    assert "prompt='the prompt'" in errors[0] and "completion='the completion'" in errors[0]
    assert "expected a list of 2 values" in errors[1] and "'high'" in errors[2]
    assert rs.last_metrics["reward_failed/boom"] == 2.0
    # the next batch goes on normally
    total, _, errors = RewardSet(["my_rewards:length"])(["a"], ["bb"], [{}])
    assert total.tolist() == [2.0] and errors == []


def test_reward_set_bad_specs():
    with pytest.raises(ValueError, match="at least one"):
        RewardSet([])
    with pytest.raises(ValueError, match=r"rewards\[0\]: unknown key"):
        RewardSet([{"name": "math", "wieght": 2}])
    with pytest.raises(ValueError, match=r"rewards\[0\].weight must be a finite number"):
        RewardSet([{"name": "math", "weight": "x"}])
    with pytest.raises(ValueError, match="must match"):
        RewardSet(["math"])(["a"], ["b", "c"])
