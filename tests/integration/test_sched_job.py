"""A real tiny GRPO job under the scheduler on the CPU: preempted in the middle of a
rollout by a higher phase of another job, it stops at an engine step boundary, sleeps,
resumes, loses no sample and ends with the weights of an unpreempted run with the same seed."""

import threading
import time

import pytest
import torch
from support.grpo_job import MEM, ROWS, TOK, config

from rlcu.data.synthetic import partial_match_reward
from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.job import ScheduledGRPO, estimate_memory, job_memory, run_grpo
from rlcu.sched.server import SchedServer
from rlcu.train.grpo import GRPOTrainer


def record(trainer):
    """Keep every rollout's samples: (group, completion tokens, sampling logprobs)."""
    got, orig = [], trainer.rollout

    def rollout(*a, **k):
        ss = orig(*a, **k)
        got.append([(s.group, list(s.completion_ids), list(s.logprobs)) for s in ss])
        return ss

    trainer.rollout = rollout
    return got


@pytest.fixture
def service(tmp_path):
    core = Core([10.0], state=tmp_path / "s.db", heartbeat_timeout=30)
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()
    yield core, SchedClient(srv.address, "tok")
    srv.stop()


def test_preempted_grpo_job_loses_nothing(tmp_path, service):
    core, client = service
    base = GRPOTrainer(config(tmp_path / "base"), ROWS, [partial_match_reward], tokenizer=TOK)
    base_samples = record(base)
    base.train()

    job = client.job("grpo", {"actor": {"devices": 1, "resident": 2.0, "peak": 4.0}}, poll_s=0.0)
    rival = client.job("rival", {"x": 1})
    tr = ScheduledGRPO(config(tmp_path / "sched"), ROWS, [partial_match_reward], tokenizer=TOK, sched=job, mem=MEM)
    samples = record(tr)
    fired = []

    def on_step(n):  # at engine step 3 of the first rollout another job wants more memory than is free
        if n != 3 or fired:
            return

        def rival_train():
            le = rival.acquire("actor_train", mem=6.0)  # 10 - 2 resident - 4 rollout = 4 free
            fired.append(le)
            time.sleep(0.2)
            rival.release(le)

        threading.Thread(target=rival_train, daemon=True).start()
        end = time.monotonic() + 10
        while not core.snapshot().yielding and time.monotonic() < end:
            time.sleep(0.01)

    tr.on_engine_step = on_step
    sleeps, sleep = [], tr.llm.sleep
    tr.llm.sleep = lambda keep_graphs=False: (sleeps.append(keep_graphs), sleep(keep_graphs))
    hist = tr.train()
    job.finish()
    rival.finish()

    assert fired and tr.yields == 1  # it was preempted once, and the rival ran in between
    spans = list(core.snapshot().spans)
    phases = [(s.job, s.phase, s.reason) for s in spans if s.phase != "resident"]
    i = phases.index(("grpo", "rollout", "yielded"))
    assert phases[i + 1] == ("rival", "actor_train", "released") and phases[i + 2][:2] == ("grpo", "rollout")
    assert [p for j, p, _ in phases if j == "grpo"] == ["init"] + ["rollout", "rollout", "ref_logprobs",
                                                                   "actor_train", "rollout", "ref_logprobs",
                                                                   "actor_train"]
    rival_span = next(s for s in spans if s.job == "rival")
    yielded = next(s for s in spans if s.reason == "yielded")
    assert yielded.end <= rival_span.start  # the rival got the memory only after the rollout let go
    # no sample lost, the same tokens; logprobs equal up to recompute rounding
    assert len(samples) == len(base_samples) == 2
    assert [[(g, c) for g, c, _ in st] for st in samples] == [[(g, c) for g, c, _ in st] for st in base_samples]
    lp = torch.tensor([x for st in samples for _, _, l in st for x in l])
    lp0 = torch.tensor([x for st in base_samples for _, _, l in st for x in l])
    assert torch.allclose(lp, lp0, atol=1e-4)
    err = (tr.model.flat - base.model.flat).norm() / base.model.flat.norm()
    assert err < 1e-5, f"weights differ: rel err {err:.2e}"
    assert hist[-1]["sched/yields"] == 1
    # the engine is the trainer's own LLM (no proxy), and every sleep, between phases and on the
    # yield, keeps the decode graphs for the next wake: a scheduled job captures them once
    assert type(tr.llm).__name__ == "LLM" and len(sleeps) == 3 and all(sleeps), sleeps
    assert core.ops.op_metrics()["mem_in_use"] == [0.0]


def test_run_grpo_api(tmp_path, service):
    core, client = service
    hist = run_grpo(config(tmp_path / "api", steps=1), client=client, name="api-job", mem=MEM,
                    dataset=ROWS, reward_fns=[partial_match_reward], tokenizer=TOK)
    assert len(hist) == 1
    (j,) = [j for j in core.snapshot().jobs.values() if j.name == "api-job"]
    assert j.state == "done" and j.wait_s >= 0
    assert {s.phase for s in core.snapshot().spans} >= {"resident", "init", "rollout", "ref_logprobs", "actor_train"}


def test_failed_job_releases_its_leases(tmp_path, service):
    core, client = service

    def bad_reward(prompts, completions, **_):
        raise KeyboardInterrupt  # not caught by the reward machinery: the job dies mid-step

    with pytest.raises(KeyboardInterrupt):
        run_grpo(config(tmp_path / "bad", steps=1), client=client, name="bad-job", mem=MEM,
                 dataset=ROWS, reward_fns=[bad_reward], tokenizer=TOK)
    assert core.snapshot().jobs["bad-job"].state == "failed" and core.snapshot().used == (0.0,)


def test_memory_estimates():
    from rlcu import memory
    from rlcu.config import GRPOConfig
    from rlcu.train import sizing

    cfg = GRPOConfig(**{k: v for k, v in config("x").items() if k not in ("model", "log", "checkpoint", "optim")})
    est = estimate_memory(cfg)  # the default (0.6B-shaped) model in bf16 or fp32
    assert est["resident"] > 5 and est["rollout"] > 0 and est["actor_train"] > est["ref_logprobs"] > 0
    assert est == memory.job_memory(sizing.config_shape(cfg)).request()  # the scheduler asks what the model says
    from rlcu.model.config import Qwen3Config
    from rlcu.model.layout import ParamLayout

    held = {gd: estimate_memory(GRPOConfig(**{**config("x"), "model": {"dtype": "bfloat16"},
                                              "optim": {"release_grads": False, "grad_dtype": gd}}))
            for gd in ("float32", "bfloat16")}
    P = ParamLayout(Qwen3Config()).numel
    assert held["float32"]["resident"] - held["bfloat16"]["resident"] == pytest.approx(
        P * 2 * memory.FRAGMENTATION / (1 << 30))
    clusters, mem = job_memory(cfg, {"rollout": 3.0})
    assert mem["rollout"] == 3.0 and clusters["actor"]["peak"] == max(v for k, v in mem.items() if k != "resident")


def test_memory_estimate_follows_the_checkpointing_and_refuses_auto():
    from rlcu.config import ConfigError, GRPOConfig
    from rlcu.memory import FRAGMENTATION, JobShape, parts
    from rlcu.model.config import Qwen3Config

    def est(mode):
        return estimate_memory(GRPOConfig(**{**config("x"), "model": {"dtype": "bfloat16",
                                                                      "gradient_checkpointing": mode}}))

    full, none, half = est(True), est(False), est(14)
    qc, T = Qwen3Config(), GRPOConfig(**config("x")).micro_batch_tokens
    kept = {k: parts.kept_activations(JobShape(qc, micro_batch_tokens=T, checkpointing=k)) for k in ("full", "none")}
    # keeping every activation keeps more, and spares the recompute of the last layer
    saved = T * parts.recompute(qc, 2, "inputs")
    assert none["actor_train"] - full["actor_train"] == pytest.approx(
        (kept["none"] - kept["full"] - saved) * FRAGMENTATION / (1 << 30))
    assert full["actor_train"] < half["actor_train"] < none["actor_train"]
    assert half["resident"] == full["resident"] and half["rollout"] == full["rollout"]
    for bad, match in (("auto", "a scheduled job shares one"), (29, "checkpoints 29 layers; the model has 28")):
        with pytest.raises(ConfigError, match=match) as e:
            est(bad)
        assert e.value.path == "model.gradient_checkpointing"


def test_a_gpu_job_takes_the_kv_pool_its_rollout_lease_holds(tmp_path, service, monkeypatch):
    """On a GPU (stood in for here) the engine's pool is what the rollout lease holds once the
    engine's step is set aside (rlcu.memory.fit.kv_blocks_for_lease), not a fraction of it."""
    import rlcu.sched.job as sj
    from rlcu.config import GRPOConfig
    from rlcu.memory import GiB
    from rlcu.memory.fit import kv_blocks_for_lease
    from rlcu.train import sizing

    _, client = service
    monkeypatch.setattr(sj, "_on_cuda", lambda cfg: True)
    mem = dict(MEM, rollout=0.05)
    job = client.job("pool", {"actor": {"devices": 1, "resident": 2.0, "peak": 4.0}}, poll_s=0.0)
    tr = ScheduledGRPO(config(tmp_path / "pool", steps=1), ROWS, [partial_match_reward], tokenizer=TOK, sched=job,
                       mem=mem)
    cfg = GRPOConfig(**config(tmp_path / "pool", steps=1))
    want = kv_blocks_for_lease(0.05 * GiB, sizing.config_shape(cfg), cfg.engine.block_size)
    assert 1000 < want == tr.llm.runner.num_blocks == tr.cfg.engine.num_kv_blocks
    job.finish()


@pytest.mark.gpu
def test_two_jobs_share_one_gpu(tmp_path):
    """Two small GRPO jobs, threads of one process, phase-shared on cuda:0 (bf16, Triton)."""
    free = torch.cuda.get_device_properties(0).total_memory / (1 << 30) * 0.5
    core = Core([free], heartbeat_timeout=60, device_names=["cuda:0"])
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok").start()
    try:
        client = SchedClient(srv.address, "tok")
        errors = []

        def one(i):
            cfg = config(tmp_path / f"g{i}", steps=2)
            cfg["model"].update(device="cuda", dtype="bfloat16")
            cfg["model"]["tiny"].update(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32)
            cfg["engine"] = {"enforce_eager": True}  # graph capture and other threads' kernels do not mix
            try:
                run_grpo(cfg, client=client, name=f"gpu{i}", dataset=ROWS, reward_fns=[partial_match_reward],
                         tokenizer=TOK, mem={"resident": 1.0, "init": 1.0, "rollout": 2.0, "ref_logprobs": 1.0,
                                             "actor_train": 2.0})
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert not errors, errors
        assert all(j.state == "done" for j in core.snapshot().jobs.values())
        assert core.snapshot().used == (0.0,)
    finally:
        srv.stop()


def test_resumable_generate_matches_generate():
    """The engine loop with yields every few steps (generate's yield_check / on_yield, what a
    scheduled job's hooks pass) makes the tokens of a plain generate."""
    from rlcu.engine import LLM, SamplingParams
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.config import Qwen3Config

    cfg = config("x")["model"]["tiny"]
    model = Qwen3.from_config(Qwen3Config(**cfg), device="cpu", dtype=torch.float32, seed=3)
    llm = LLM(model, num_kv_blocks=64, block_size=4)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [6, 7]}, {"prompt_token_ids": [8, 9, 10]}]
    sps = [SamplingParams(n=3, temperature=1.0, max_tokens=9, seed=11 + i, logprobs=True, ignore_eos=True)
           for i in range(3)]
    ref = llm.generate(prompts, sps, use_tqdm=False)
    calls, pauses = [0], []

    def should_yield():
        calls[0] += 1
        return calls[0] % 4 == 0

    got = llm.generate(prompts, sps, use_tqdm=False, yield_check=should_yield, on_yield=pauses.append)
    assert len(pauses) >= 2 and not llm.asleep and pauses[0] > pauses[-1] > 0  # work left shrinks
    for a, b in zip(ref, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5)
            assert ca.finish_reason == cb.finish_reason


def test_missing_data_file_is_one_line_exit_2(tmp_path, service, capsys):
    """A scheduled job whose data.path does not exist ends as a plain run does, one line and
    exit 2 (it was a FileNotFoundError traceback), and the service marks it failed."""
    from rlcu.sched.job import run_grpo_exit_code

    core, client = service
    cfg = config(tmp_path / "nodata", steps=1)
    cfg["data"] = {"path": str(tmp_path / "nope.jsonl")}
    rc = run_grpo_exit_code("rlcu grpo", cfg, client=client, name="nodata", mem=MEM, tokenizer=TOK)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "data.path" in err and "nope.jsonl" in err and len(err.strip().splitlines()) == 1, err
    assert core.snapshot().jobs["nodata"].state == "failed" and core.snapshot().used == (0.0,)
