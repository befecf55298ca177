"""bench/grpo_tools.py, the H200 benchmark of a multi-turn GRPO step with a tool beside TRL's
GRPOTrainer(tools=...), at its quick shape on the CPU: each side's scripted turns make the same
episodes (4 turns, 3 tool calls of the same answer), and neither side's patch outlives its run."""

import pytest

from bench import grpo_tools as gt


def test_rlcu_side_runs_four_turns_with_three_tool_calls():
    from rlcu.train import episodes

    kept = episodes.EpisodeState
    gt.TOOL.update(sleep=0.0, tokens=gt.QUICK["tool_tokens"], words=500)
    r = gt.bench_rlcu(gt.QUICK, 1, 0, True, 16384)
    assert episodes.EpisodeState is kept
    e, q = r["episodes"], gt.QUICK
    assert e["episodes/turns"] == e["episodes/turns_max"] == q["turns"]
    assert e["episodes/tool_calls"] == q["turns"] - 1 and e["episodes/tool_errors"] == 0
    n = q["prompts"] * q["group"]
    assert r["model_tokens_per_step"] == n * q["turns"] * q["turn_tokens"]
    # a tool turn: <|im_end|> (the close the turn did not sample), <|im_start|> tool, the answer, <|im_end|>,
    # <|im_start|> assistant
    T, turns = q["turn_tokens"], q["turns"]
    assert r["trajectory_tokens_per_step"] == n * (turns * T + (turns - 1) * (q["tool_tokens"] + 6))
    assert r["s_per_step"] > 0 and r["phases_s"]["generate"] > 0


def test_trl_side_runs_the_same_episodes():
    pytest.importorskip("trl")
    from trl.trainer import grpo_trainer

    kept = grpo_trainer.parse_response
    gt.TOOL.update(sleep=0.0, tokens=gt.QUICK["tool_tokens"], words=500)
    r = gt.bench_trl(gt.QUICK, 1, 0, True)
    assert grpo_trainer.parse_response is kept
    q = gt.QUICK
    assert r["logged"]["tools/call_frequency"] == q["turns"] - 1 and r["logged"]["tools/failure_frequency"] == 0
    assert r["logged"]["completions/mean_length"] == q["turns"] * q["turn_tokens"]  # TRL counts the model's only
    n = q["prompts"] * q["group"]
    # TRL's tool suffix takes the assistant's close as sampled: one token fewer than rlcu's per tool turn
    T, turns = q["turn_tokens"], q["turns"]
    assert r["trajectory_tokens_per_step"] == n * (turns * T + (turns - 1) * (q["tool_tokens"] + 5))


def test_a_trl_without_the_tool_loop_it_scripts_is_named_and_a_side_past_its_time_is_an_error(tmp_path):
    """The bench refuses a TRL whose tool API differs (it would measure something else, or loop on
    the scripted calls) by what it lacks, and a side that runs past --timeout is killed, its error
    in the bench's own JSON, which is written all the same."""
    import dataclasses
    import json
    import types

    @dataclasses.dataclass
    class GRPOConfig:
        generation_kwargs: dict | None = None

    class GRPOTrainer:
        def __init__(self, model, reward_funcs, args=None):
            pass

    fake = types.SimpleNamespace(GRPOConfig=GRPOConfig, GRPOTrainer=GRPOTrainer)
    assert gt.trl_api_gaps(fake, types.SimpleNamespace()) == [
        "trl.trainer.grpo_trainer.parse_response", "GRPOTrainer(tools=...)", "GRPOConfig.max_tool_calling_iterations"]
    trl = pytest.importorskip("trl")
    from trl.trainer import grpo_trainer

    assert gt.trl_api_gaps(trl, grpo_trainer) == []  # the TRL the tests install (1.16) runs
    assert gt.main(["--quick", "--sides", "rlcu", "--timeout", "1", "--out-dir", str(tmp_path)]) == 1
    r = json.loads((tmp_path / "grpo_tools_quick.json").read_text())
    assert r["rlcu"]["error"].startswith("timed out after 1 s (--timeout)")
