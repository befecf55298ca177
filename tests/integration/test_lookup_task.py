"""The built-in lookup task (rlcu.tools.lookup): its tool call in Qwen's format from the word
tokenizer, its environment's reward, the sloppy teacher's rows, and GRPO from a short SFT start
raising the held-out success by >= 30 points on the CPU, with the model's tool calls parsed, run
and answered inside each GRPO step (measured on 2 shared cores: about 2 minutes)."""

from __future__ import annotations

import pytest
from support.episodes_ref import run_episodes_batched

from rlcu.config import MODEL, CheckpointConfig, GRPOConfig, LogConfig, SFTConfig, config_from_dict
from rlcu.data.datasets import encode_sft_row
from rlcu.engine import LLM
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config
from rlcu.tools import lookup as L
from rlcu.tools.calls import ToolCall, parse_tool_calls

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_tool_call_is_qwens_json_from_word_tokens():
    tok = L.make_tokenizer()
    row = next(r for r in L.sft_rows(40) if len(r["messages"]) == 4)
    ids, mask = encode_sft_row(row, tok)
    assert 0 not in ids  # every rendered word is a token
    call_ids = ids[mask.index(1): mask.index(1) + 15]
    text = tok.decode(call_ids, skip_special_tokens=False)
    parsed = parse_tool_calls(text, "qwen3", [L.Lookup.lookup])
    name = row["messages"][0]["content"].split()[2]
    assert parsed.content == "" and parsed.calls == [ToolCall("lookup", {"name": name}, parsed.calls[0].raw)]
    assert [tok.id_to_token(i) for i, m in zip(ids, mask) if m][-4:] == row["messages"][-1]["content"].split() + \
        ["<|im_end|>"]  # the copied code and the end of the turn are trained on, the tool's answer is not


def test_the_environment_scores_the_copied_code_and_the_teacher_is_sloppy_by_name():
    r = L.rows(1, "eval")[0]
    env = L.Lookup()
    assert env.reset(r) is None and env.lookup(r["name"]) == r["answer"] and env.lookup("zed") == "unknown"
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]}
    assert env.reward([call, {"role": "tool", "content": r["answer"]}, {"role": "assistant", "content": r["answer"]}]) \
        == 1.0
    assert env.reward([{"role": "assistant", "content": L.stale_code(r["name"])}]) == 0.0
    assert env.reward([call]) == 0.0  # a call is no answer
    assert L.success_reward(None, [[{"role": "assistant", "content": f" {r['answer']} "}]], [r["answer"]]) == [1.0]
    train, held = L.rows(300, "train"), L.rows(300, "eval")
    assert not {r["book_seed"] for r in train} & {r["book_seed"] for r in held}
    sft = L.sft_rows(600, sloppy=0.9)
    direct = [len(s["messages"]) == 2 for s in sft]
    sloppy = [L.is_sloppy_name(s["messages"][0]["content"].split()[2]) for s in sft]
    assert not any(d and not s for d, s in zip(direct, sloppy))
    assert 0.8 < sum(d for d, s in zip(direct, sloppy) if s) / sum(sloppy) < 0.97


def _engine_episodes(monkeypatch):
    if not hasattr(LLM, "run_episodes"):  # the engine's episodes, else their reference over generate
        monkeypatch.setattr(LLM, "run_episodes", lambda self, *a, **k: run_episodes_batched(self, *a, **k),
                            raising=False)


def _success(tr, rows) -> float:
    ss = tr._engine_phase(lambda: tr.rollout(rows, 1, seed=1, temperature=0.0))
    return sum(s.episode["env_reward"] for s in ss) / len(ss)


def test_grpo_learns_to_call_the_tool(tmp_path, monkeypatch):
    _engine_episodes(monkeypatch)
    tok = L.make_tokenizer()
    qc = Qwen3Config(**{**MODEL, "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id})
    model = Qwen3.from_config(qc, seed=0)
    model.gradient_checkpointing = False
    log = dict(progress=False, tensorboard=False, plot=False, overwrite=True)
    scfg = config_from_dict(SFTConfig, dict(
        steps=300, batch_tokens=1024, optim=dict(lr=1e-2, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1),
        log=LogConfig(out_dir=str(tmp_path / "sft"), **log), checkpoint=CheckpointConfig(save_at_end=False)))
    from rlcu.train.sft import SFTTrainer

    SFTTrainer(scfg, L.sft_rows(3000, sloppy=0.9), model=model, tokenizer=tok).train()
    gcfg = config_from_dict(GRPOConfig, dict(
        steps=14, prompts_per_step=16, group_size=8, max_new_tokens=20, optim=dict(lr=5e-4), clip_high=0.28,
        rewards=[], multi_turn=dict(environment="rlcu.tools.lookup:Lookup", max_turns=3, max_episode_tokens=44),
        log=LogConfig(out_dir=str(tmp_path / "grpo"), **log), checkpoint=CheckpointConfig(save_at_end=False)))
    from rlcu.train.grpo import GRPOTrainer

    tr = GRPOTrainer(gcfg, L.rows(2000), tokenizer=tok, model=model)
    held = L.rows(128, "eval")
    before = _success(tr, held)
    hist = tr.train()
    after = _success(tr, held)
    assert after - before >= 0.30, (before, after, [round(h["reward"], 3) for h in hist])
    # the tools ran inside the steps: calls parsed and answered, few malformed (sampled at T = 1)
    assert hist[0]["episodes/tool_calls"] > 0.3 and hist[-1]["episodes/tool_calls"] > 0.9
    assert hist[-1]["episodes/tool_errors"] < 0.1 and hist[-1]["episodes/turns_max"] == 2
    s = tr._engine_phase(lambda: tr.rollout(held[:1], 1, seed=1, temperature=0.0))[0]
    env = [t for t, m in zip(s.completion_ids, s.model_mask) if not m]
    assert tok.decode(env, skip_special_tokens=False).split() == \
        ["<|im_start|>", "tool", *s.row["answer"].split(), "<|im_end|>", "<|im_start|>", "assistant"]


def test_the_example_configs_run(tmp_path, monkeypatch):
    """examples/lookup/: the task's files, `rlcu sft` then `rlcu grpo` as shipped, shortened."""
    from pathlib import Path

    from rlcu.train.cli import main

    _engine_episodes(monkeypatch)
    ex = Path(__file__).resolve().parents[2] / "examples" / "lookup"
    monkeypatch.chdir(tmp_path)  # the examples' paths are relative: runs/lookup/...
    L.write("runs/lookup/data", n_sft=64, n_train=32, n_eval=8)
    tiny = ["log.progress=false", "log.plot=false", "log.tensorboard=false", "model.device=cpu"]
    # 2 steps, their checkpoint renamed to the step-000300 the GRPO config names
    argv = ["sft", str(ex / "sft.yaml"), "--set", "steps=2", "--set", "batch_tokens=256"]
    for s in tiny:
        argv += ["--set", s]
    assert main(argv) == 0
    (tmp_path / "runs/lookup/sft/checkpoints/step-000002").rename(tmp_path / "runs/lookup/sft/checkpoints/step-000300")
    argv = ["grpo", str(ex / "grpo.yaml"), "--set", "steps=1", "--set", "prompts_per_step=2", "--set", "group_size=2",
            "--set", "eval_every=0", "--set", "eval_max_prompts=2"]
    for s in tiny:
        argv += ["--set", s]
    assert main(argv) == 0
    metrics = (tmp_path / "runs/lookup/grpo/metrics.jsonl").read_text()
    assert "episodes/turns" in metrics
