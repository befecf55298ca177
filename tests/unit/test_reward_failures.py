"""Rewards that fail: masked per function and per sample, a batch that raises retried one
sample at a time, nan / inf counted as failures, a time limit (thread and process workers),
and RewardsFailed after N steps in a row of a function failing on every sample."""

import math
import sys
import time

import pytest
import torch

from rlcu.rewards import RewardSet, RewardsFailed, TrainerState

_MOD = '''
import time
def ok(prompts, completions, **kw):
    return [float(len(c)) for c in completions]
def picky(prompts, completions, **kw):
    # raises on a batch that holds a "bad" completion: fine one sample at a time
    if any("bad" in c for c in completions):
        raise KeyError("bad completion")
    return [1.0] * len(completions)
def nonfinite(prompts, completions, **kw):
    return [float(c) for c in completions]
def always(prompts, completions, **kw):
    raise RuntimeError("service down")
def hang_on_slow(prompts, completions, **kw):
    if any(c == "slow" for c in completions):
        time.sleep(30)
    return [2.0] * len(completions)
def spin(prompts, completions, **kw):
    if any(c == "spin" for c in completions):
        while True:
            pass
    return [3.0] * len(completions)
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "failing_rewards.py").write_text(_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("failing_rewards")
    sys.modules.pop("failing_rewards", None)


def test_one_failing_function_masks_only_its_samples(mod):
    # picky raises on the batch: called again one sample at a time, only the "bad" sample fails
    rs = RewardSet([mod.ok, mod.picky])
    total, parts, errors = rs(["p"] * 4, ["a", "bad", "ccc", "dd"], [{}] * 4)
    assert parts["ok"].tolist() == [1.0, 3.0, 3.0, 2.0]  # the other function's values stand
    assert parts["picky"][[0, 2, 3]].tolist() == [1.0, 1.0, 1.0] and math.isnan(parts["picky"][1])
    assert total[[0, 2, 3]].tolist() == [2.0, 4.0, 3.0]
    assert math.isnan(total[1])  # a sample with a failed component is masked
    assert len(errors) == 1 and "reward 'picky' failed on 1 of 4 samples" in errors[0]
    assert "KeyError: 'bad completion'" in errors[0] and "#1" in errors[0] and "completion='bad'" in errors[0]
    assert "one sample at a time: 3 of 4 ok" in errors[0]
    assert rs.last_metrics == {"reward_failed/picky": 1.0}


def test_nonfinite_values_are_failures(mod):
    rs = RewardSet([mod.nonfinite])
    total, _, errors = rs(["p"] * 4, ["1", "inf", "nan", "-2"], [{}] * 4)
    assert total[0] == 1.0 and total[3] == -2.0
    assert torch.isnan(total[1]) and torch.isnan(total[2])
    assert len(errors) == 1 and "failed on 2 of 4 samples" in errors[0] and "returned inf (not finite)" in errors[0]
    assert "returned nan" in errors[0] or "1 other error" in errors[0]
    assert "completion='inf'" in errors[0]
    assert rs.last_metrics["reward_failed/nonfinite"] == 2.0


def test_failing_every_sample_stops_after_n_steps(mod):
    rs = RewardSet([mod.ok, mod.always], max_failed_steps=3)
    for step in range(2):
        for _ in range(2):  # two batches of one step (dynamic sampling, evaluation) count once
            total, _, errors = rs(["p"] * 2, ["a", "b"], [{}] * 2, trainer_state=TrainerState(global_step=step))
            assert torch.isnan(total).all() and "RuntimeError: service down" in errors[0]
    with pytest.raises(RewardsFailed, match=r"reward 'always' failed on every sample for 3 steps in a row") as ei:
        rs(["p"] * 2, ["a", "b"], [{}] * 2, trainer_state=TrainerState(global_step=2))
    assert ei.value.name == "always" and "RuntimeError: service down" in ei.value.first_error
    # a step where it scores something breaks the streak
    rs = RewardSet([mod.picky], max_failed_steps=2)
    rs(["p"], ["bad"], [{}])
    rs(["p"], ["fine"], [{}])
    rs(["p"], ["bad"], [{}])
    with pytest.raises(RewardsFailed):
        rs(["p"], ["bad"], [{}])
    # 0: never stop
    rs = RewardSet([mod.always], max_failed_steps=0)
    for _ in range(5):
        rs(["p"], ["a"], [{}])


def test_thread_timeout(mod):
    rs = RewardSet([mod.ok, mod.hang_on_slow], timeout_s=0.5, workers="thread")
    t0 = time.perf_counter()
    total, parts, errors = rs(["p"] * 3, ["a", "slow", "c"], [{}] * 3)
    assert time.perf_counter() - t0 < 5
    assert torch.isnan(total).all() and parts["ok"].tolist() == [1.0, 4.0, 1.0]
    assert "timed out after 0.5 s (reward_timeout_s)" in errors[0]
    total, _, errors = rs(["p"], ["fast"], [{}])  # the next call is served
    assert total.tolist() == [6.0] and errors == []


def test_main_thread_timeout_interrupts(mod):
    import signal
    import threading

    def swallow(prompts, completions, **kw):  # a broad except must not swallow the interrupt
        while True:
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001, S110 - the point of the test
                pass

    def alarm_inside(prompts, completions, **kw):  # signal-based timeouts work: the main thread
        assert threading.current_thread() is threading.main_thread()
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        try:
            signal.signal(signal.SIGALRM, lambda *a: None)
            time.sleep(0.2)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return [5.0] * len(completions)

    rs = RewardSet([mod.ok, mod.hang_on_slow, mod.spin, swallow, alarm_inside], timeout_s=0.3)
    t0 = time.perf_counter()
    total, parts, errors = rs(["p"] * 2, ["slow", "spin"], [{}] * 2)
    assert time.perf_counter() - t0 < 5
    assert torch.isnan(total).all() and parts["ok"].tolist() == [4.0, 4.0]
    assert parts["alarm_inside"].tolist() == [5.0] * 2
    assert len(errors) == 3 and all("timed out after 0.3 s (reward_timeout_s); interrupted" in e for e in errors)
    # nothing is left behind: the next calls run normally and no stray signal arrives
    rs = RewardSet([mod.ok, mod.spin], timeout_s=0.3)
    for _ in range(3):
        total, _, errors = rs(["p"], ["abc"], [{}])
        assert total.tolist() == [6.0] and errors == []
    time.sleep(1.2)


def test_process_timeout_kills_the_worker(mod):
    rs = RewardSet([{"fn": "failing_rewards:spin"}], timeout_s=1.0, workers="process")
    try:
        total, _, errors = rs(["p"] * 2, ["x", "y"], [{}] * 2)
        assert total.tolist() == [3.0, 3.0] and errors == []
        proc = rs.fns[0].runner.proc
        t0 = time.perf_counter()
        total, _, errors = rs(["p"] * 2, ["x", "spin"], [{}] * 2)
        assert time.perf_counter() - t0 < 10
        assert torch.isnan(total).all() and "timed out after 1 s" in errors[0] and "killed" in errors[0]
        assert not proc.is_alive()
        total, _, errors = rs(["p"], ["z"], [{}])  # a fresh worker serves the next call
        assert total.tolist() == [3.0] and errors == []
    finally:
        rs.close()


def test_process_workers_need_importable_functions():
    with pytest.raises(ValueError, match="reward_workers=process needs a function importable by name"):
        RewardSet([lambda prompts, completions, **kw: [0.0] * len(completions)], timeout_s=1, workers="process")
    with pytest.raises(ValueError, match="reward_workers must be one of main, thread, process"):
        RewardSet([lambda prompts, completions, **kw: [0.0]], timeout_s=1, workers="fork")
