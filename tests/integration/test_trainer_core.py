"""The trainer core (rlcu.train.core): a fresh run never writes into another run's folder,
keep_last never prunes what a run just wrote, resume's one-line refusals (a missing
checkpoint, another kind of run, another model size, changed settings), the non-finite abort
that saves nothing non-finite, the baseline evaluation at step 0, one tokenizer loader, the
phase hooks (and the engine keeping its graphs through every sleep), and
engine.gpu_memory_utilization's one meaning and default."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
import yaml
from support.run_util import TINY, TOK

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rl_config(out, **kw) -> dict:
    d = dict(model=dict(tiny=dict(TINY), init_seed=3), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
             micro_batch_tokens=64, optim=dict(lr=3e-3), rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}],
             log=dict(out_dir=str(out), progress=False, tensorboard=False, plot=False), seed=5)
    for k, v in kw.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def grpo(out, rows=None, **kw):
    from rlcu.train.grpo import GRPOTrainer

    return GRPOTrainer(rl_config(out, **kw), rows or syn.sort_rows(16, "train", min_len=2, max_len=3), tokenizer=TOK)


def write_cli_run(tmp_path, name="run.yaml", **kw) -> str:
    TOK.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(16, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")
    cfg = rl_config(tmp_path / "out", **kw)
    cfg["model"]["tokenizer"] = str(tmp_path / "tok")
    cfg["data"] = {"path": str(tmp_path / "train.jsonl")}
    (tmp_path / name).write_text(yaml.safe_dump(cfg))
    return str(tmp_path / name)


# ---------------------------------------------------------------- item 1: the run folder
def test_fresh_run_into_a_used_out_dir_is_refused(tmp_path, capsys):
    from rlcu.errors import SetupError
    from rlcu.train.cli import main

    y = write_cli_run(tmp_path, checkpoint=dict(every=1, keep_last=1))
    assert main(["grpo", y, "--set", "steps=3"]) == 0
    ck = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-000003"]
    capsys.readouterr()
    # a fresh run into the same folder: one line, exit 2, nothing touched
    assert main(["grpo", y]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a run" in err and "--overwrite" in err
    assert sorted(p.name for p in ck.iterdir()) == ["step-000003"]
    with pytest.raises(SetupError, match="already holds a run"):
        grpo(tmp_path / "out").train()
    # --overwrite: the old run is cleared first, so the new run's checkpoints survive keep_last
    (tmp_path / "out" / "notes.md").write_text("mine")
    assert main(["grpo", y, "--overwrite"]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "out" / "notes.md").read_text() == "mine"  # not a run file: kept
    assert "replaced the earlier run" in (tmp_path / "out" / "log.txt").read_text()


def test_keep_last_never_prunes_the_checkpoint_just_written(tmp_path):
    from rlcu.train.checkpoint import save_checkpoint

    m = syn_model()
    for s in (10, 20):  # another branch of the run, at higher steps
        save_checkpoint(tmp_path, s, m, None, {}, keep_last=1)
    for s in (3, 4, 5):
        p = save_checkpoint(tmp_path, s, m, None, {}, keep_last=2)
        assert p.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005", "step-000020"]


def syn_model():
    import rlcu

    return rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), seed=0)


# ---------------------------------------------------------------- item 6: resume's refusals
def test_resume_refusals_are_one_line(tmp_path, capsys):
    from rlcu.train.cli import main
    from rlcu.train.sft import SFTTrainer

    y = write_cli_run(tmp_path, checkpoint=dict(every=1))
    assert main(["grpo", y, "--resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope does not exist" in err
    # an SFT checkpoint given to grpo --resume
    rows = [{"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4]}] * 4
    sft = SFTTrainer({"steps": 1, "log": {"out_dir": str(tmp_path / "sft"), "progress": False, "plot": False}},
                     rows, model=syn_model())
    sft.train()
    capsys.readouterr()
    assert main(["grpo", y, "--resume", str(sft.last_checkpoint)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "an SFT checkpoint" in err and "model.path=" in err
    # a GRPO checkpoint given to sft and ppo
    assert main(["grpo", y]) == 0
    ck = tmp_path / "out" / "checkpoints" / "step-000002"
    with pytest.raises(Exception, match="a GRPO checkpoint"):
        SFTTrainer({"checkpoint": {"resume": str(ck)}, "log": {"out_dir": str(tmp_path / "s2")}}, rows,
                   model=syn_model()).train()
    capsys.readouterr()
    # another model size
    assert main(["grpo", y, "--set", "model.tiny.hidden_size=64", "--set", "steps=3", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another model" in err and "hidden_size 32 (this run: 64)" in err
    # changed settings: listed and refused, accepted with --allow-config-change; config.yaml kept
    saved = (tmp_path / "out" / "config.yaml").read_text()
    assert main(["grpo", y, "--set", "steps=3", "--set", "seed=6", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "seed: 5 -> 6" in err and "steps" not in err.split("--allow")[0]  # steps is safe (constant lr)
    assert main(["grpo", y, "--set", "steps=3", "--set", "seed=6", "--resume", "auto", "--allow-config-change"]) == 0
    assert (tmp_path / "out" / "config.yaml").read_text() == saved
    again = yaml.safe_load((tmp_path / "out" / "config.resume-step-000002.yaml").read_text())
    assert again["seed"] == 6 and again["steps"] == 3
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "settings changed since step-000002: seed: 5 -> 6; steps: 2 -> 3" in log
    # a checkpoint written before an option existed: the option at its default is no change
    from rlcu.config import GRPOConfig
    from rlcu.train.resume import check_config

    ck = tmp_path / "out" / "checkpoints" / "step-000003"
    state = json.loads((ck / "trainer_state.json").read_text())
    del state["config"]["mu"], state["config"]["log"]["every"]
    now = load_config_like(state["config"])
    assert check_config(ck, state, now, print) == {}
    now.mu, now.checkpoint.allow_config_change = 2, False
    with pytest.raises(Exception, match="mu: None -> 2"):
        check_config(ck, state, now, print)
    assert GRPOConfig().mu == 1


def load_config_like(d: dict):
    from rlcu.config import GRPOConfig, config_from_dict

    return config_from_dict(GRPOConfig, d)


# ---------------------------------------------------------------- item 8: the abort after non-finite steps
def test_abort_never_saves_a_non_finite_state(tmp_path):
    from rlcu.train.sft import SFTTrainer

    class Poisoned(SFTTrainer):
        def train_step(self, step=None):
            if self.step == 2:  # a step whose update made the weights NaN while its loss was finite
                self.model.flat[0] = math.nan
            return super().train_step(step)

    rows = [{"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4]}] * 4
    tr = Poisoned({"steps": 8, "optim": {"max_nonfinite_in_row": 2}, "checkpoint": {"every": 1, "keep_last": 0},
                   "log": {"out_dir": str(tmp_path), "progress": False, "plot": False}}, rows, model=syn_model())
    with pytest.raises(RuntimeError, match=r"weights are not finite, so nothing was saved; the last checkpoint is "
                                           r".*step-000002"):
        tr.train()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002"]  # no periodic checkpoint of the NaN state either
    log = (tmp_path / "log.txt").read_text()
    assert "step 3: the weights are not finite: no checkpoint written" in log


# ---------------------------------------------------------------- item 10: the baseline evaluation
def test_baseline_eval_at_step_zero(tmp_path):
    tr = grpo(tmp_path / "a", data=dict(eval_size=3), steps=2)
    hist = tr.train()
    assert hist[0]["step"] == 0 and "eval/reward" in hist[0] and "loss" not in hist[0]
    assert [h["step"] for h in hist] == [0, 1, 2] and "eval/reward" in hist[-1]
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


# ---------------------------------------------------------------- one tokenizer loader
def test_tokenizer_json_path_reads_the_files_beside_it(tmp_path):
    from rlcu.data.tokenizer import make_word_tokenizer

    tmpl = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    tok = make_word_tokenizer(syn.WORDS, special_tokens=syn.SPECIAL, chat_template=tmpl)
    tok.save_pretrained(tmp_path / "tok")
    from rlcu.train.grpo import GRPOTrainer

    cfg = rl_config(tmp_path / "run")
    cfg["model"]["tokenizer"] = str(tmp_path / "tok" / "tokenizer.json")
    tr = GRPOTrainer(cfg, syn.sort_rows(8, "train", min_len=2, max_len=3))
    assert tr.tokenizer.chat_template == tmpl and tr.tokenizer.eos_token_id == TOK.eos_token_id


# ---------------------------------------------------------------- phase hooks
class Recorder:
    preemptible = True

    def __init__(self):
        self.phases, self.checks = [], 0

    @contextlib.contextmanager
    def phase(self, name, **info):
        self.phases.append(name)
        yield

    def yield_check(self):
        self.checks += 1
        return False

    def on_yield(self, tokens_left):
        raise AssertionError("never asked to yield")

    def metrics(self):
        return {"hooked": 1}


def test_phase_hooks_and_kept_graphs(tmp_path):
    from rlcu.train.ppo import PPOTrainer

    h = Recorder()
    tr = grpo(tmp_path / "g", steps=2, kl_coef=0.1)
    tr.hooks = h
    sleeps = []
    orig = tr.llm.sleep
    tr.llm.sleep = lambda keep_graphs=False: (sleeps.append(keep_graphs), orig(keep_graphs))
    hist = tr.train()
    assert h.phases == ["rollout", "ref_logprobs", "actor_train"] * 2
    assert h.checks > 0 and all(r["hooked"] == 1 for r in hist)  # the engine asked the hooks between steps
    assert sleeps == [True, True]  # every sleep keeps the decode graphs for the next wake
    h = Recorder()
    cfg = rl_config(tmp_path / "p", steps=2, group_size=1, critic=dict(warmup_steps=1))
    tr = PPOTrainer(cfg, syn.sort_rows(16, "train", min_len=2, max_len=3), tokenizer=TOK, hooks=h)
    tr.train()
    assert h.phases == ["rollout", "ref_logprobs", "critic_values", "critic_train",
                        "rollout", "ref_logprobs", "critic_values", "actor_train", "critic_train"]


def test_scheduled_job_has_no_proxies():
    import inspect

    from rlcu.engine import LLM
    from rlcu.sched import job

    src = inspect.getsource(job)
    assert "__getattr__" not in src and "def _policy_update" not in src and "def _make_engine" not in src
    assert "rl_trainer import _config" not in src
    assert issubclass(job.JobHooks, __import__("rlcu.train.core", fromlist=["Hooks"]).Hooks)
    assert LLM is not None


# ---------------------------------------------------------------- engine.gpu_memory_utilization
def test_gpu_memory_utilization_one_default_and_honoured(tmp_path):
    import inspect

    from rlcu.config import GPU_MEMORY_UTILIZATION, EngineConfig
    from rlcu.engine import LLM

    assert EngineConfig().gpu_memory_utilization is None
    assert inspect.signature(LLM).parameters["gpu_memory_utilization"].default is None
    llm = LLM(syn_model(), num_kv_blocks=8)
    assert llm.runner.gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    # the default: a pool for one step's sequences
    tr = grpo(tmp_path / "a")
    step_sized = tr.llm.runner.num_blocks
    # an explicit utilisation sizes the pool from memory (the engine's own rule; on the CPU its
    # default of 4 longest sequences), not from the step
    tr = grpo(tmp_path / "b", engine=dict(gpu_memory_utilization=0.3))
    assert tr.llm.runner.gpu_memory_utilization == 0.3
    assert tr.llm.runner.num_blocks == LLM(syn_model()).runner.num_blocks != step_sized
    tr = grpo(tmp_path / "c", engine=dict(num_kv_blocks=40, gpu_memory_utilization=0.3))
    assert tr.llm.runner.num_blocks == 40
    assert torch.get_num_threads() == 1


@pytest.mark.gpu
def test_engine_graphs_are_captured_once_through_sleeps_and_yields(tmp_path):
    """On CUDA the engine sleeps after every rollout and on a yield; the decode graphs are kept
    through both (the pool comes back at its address), so later steps capture none."""

    class YieldOnce(Recorder):
        def yield_check(self):
            self.checks += 1
            return tr.step >= 1 and not hasattr(self, "yielded")  # once, in a later rollout

        def on_yield(self, tokens_left):
            self.yielded = tokens_left

    tr = grpo(tmp_path, steps=4, max_new_tokens=8, model=dict(device="cuda", dtype="bfloat16"))
    h = tr.hooks = YieldOnce()
    runner = tr.llm.runner
    captures, orig = [], runner.decode_graphs.capture
    runner.decode_graphs.capture = lambda b, kb, *a: (captures.append((tr.step, b, kb)), orig(b, kb, *a))
    tr.train()
    # the engine's start captured them (engine/warmup.py); any left over come in the first step
    assert runner.graphs and all(s == 0 for s, _, _ in captures), captures
    assert getattr(h, "yielded", None) is not None
    assert runner.graph_wakes["kept"] >= 3 and runner.graph_wakes["recaptured"] == 0, runner.graph_wakes
