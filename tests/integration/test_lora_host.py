"""A LoRA host (issue 35, rlcu.train.lora_host): several LoRA GRPO jobs on one base in one process,
each equal to the same job run alone (exact mode bit for bit, the default mode close), their
rollouts sharing engine steps, one copy of the base, a failing job leaving the others, the
refusals by file and field, a hosted job's checkpoint resumed, and `rlcu grpo a.yaml b.yaml`."""

import json

import pytest
import torch
import yaml
from support.trainers import TINY, first_is_even, grpo_config

from rlcu.config import ConfigError
from rlcu.data import synthetic as syn
from rlcu.train.grpo import GRPOTrainer
from rlcu.train.lora_host import LoraHost

ROWS = syn.sort_rows(64, "train", min_len=2, max_len=3)


def job(tmp_path, i: int, out: str, **kw):
    """Job i: its own adapter seed, sampling seed and learning rate (and `kw`), on the shared base."""
    d = dict(steps=3, lora=dict(r=4, alpha=8, seed=i), seed=5 + i, optim=dict(lr=3e-2 * (i + 1)))
    for k, v in kw.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return grpo_config(tmp_path / f"{out}{i}", **d)


def host_of(tmp_path, n: int, out: str = "h", rewards=None, each=None, **kw):
    cfgs = [job(tmp_path, i, out, **{**kw, **((each or {}).get(i, {}))}) for i in range(n)]
    return LoraHost([c for c, _ in cfgs], [ROWS] * n, [rewards or [first_is_even]] * n,
                    tokenizers=[t for _, t in cfgs])


def alone(tmp_path, i: int, **kw):
    """Job i run by itself; returns (trainer, engine steps over its run)."""
    cfg, tok = job(tmp_path, i, "alone", **kw)
    tr = GRPOTrainer(cfg, ROWS, [first_is_even], tokenizer=tok)
    steps, gen = [0], tr.llm.generate

    def counted(*a, **k):
        out = gen(*a, **k)
        steps[0] += tr.llm.stats["steps"]
        return out

    tr.llm.generate = counted
    tr.train()
    return tr, steps[0]


def losses(hist):
    return [(h["loss"], h["reward"], h["grad_norm"]) for h in hist]


def test_host_jobs_equal_each_alone_exact_mode(tmp_path):
    host = host_of(tmp_path, 3, exact=True)
    jobs = host.train()
    assert [j.status for j in jobs] == [0, 0, 0] and host.status == 0
    base = host.base.flat
    assert all(j.trainer.model.flat.data_ptr() == base.data_ptr() for j in jobs)  # one copy of the base
    assert host.engine.in_place  # the adapters are the rows of one slab: no copy per generate
    slab = host.engine.slab
    assert all(j.trainer.model.lora.flat.data_ptr() == slab[i].data_ptr() for i, j in enumerate(jobs))
    base0 = base.clone()
    sep_steps = 0
    for i, j in enumerate(jobs):
        tr, steps = alone(tmp_path, i, exact=True)
        sep_steps += steps
        assert torch.equal(j.trainer.model.lora.flat, tr.model.lora.flat), i  # bit for bit
        assert not torch.equal(tr.model.lora.flat, jobs[(i + 1) % 3].trainer.model.lora.flat)
        assert losses(j.history) == losses(tr.history)
        assert (tmp_path / f"h{i}" / "run" / "adapter" / "adapter_config.json").is_file()  # its own run folder
    assert torch.equal(base, base0)
    # the rollouts shared the engine's steps: fewer than the separate runs' together
    assert 0 < host.engine.engine_steps < sep_steps


def test_host_default_mode_ranks_that_differ_are_close(tmp_path):
    host = host_of(tmp_path, 2, each={1: dict(lora=dict(r=8, alpha=16, seed=1))})
    jobs = host.train()
    assert [j.status for j in jobs] == [0, 0]
    assert not host.engine.in_place  # two layouts: the slots copy the live adapters every generate
    for i, j in enumerate(jobs):
        tr, _ = alone(tmp_path, i, **({"lora": dict(r=8, alpha=16, seed=1)} if i == 1 else {}))
        a, b = j.trainer.model.lora.flat, tr.model.lora.flat
        assert float((a - b).norm() / b.norm()) < 1e-4, i


def boom(prompts, completions, **_):
    raise RuntimeError("this reward always fails")


def test_a_failing_job_leaves_the_others(tmp_path, capsys):
    cfgs = [job(tmp_path, i, "f", reward_max_failed_steps=1) for i in range(3)]
    host = LoraHost([c for c, _ in cfgs], [ROWS, ROWS, []], [[first_is_even], [boom], [first_is_even]],
                    tokenizers=[t for _, t in cfgs])
    jobs = host.train()
    assert [j.status for j in jobs] == [0, 1, 2]  # done; its reward failed; its dataset is empty
    assert host.status == 2  # the worst
    assert len(jobs[0].history) == 3 and jobs[1].history == []
    err = capsys.readouterr().err
    assert "rlcu grpo [job1]: reward 'boom' failed" in err and "rlcu grpo [job2]: dataset: no rows" in err
    tr, _ = alone(tmp_path, 0)
    assert torch.equal(jobs[0].trainer.model.lora.flat, tr.model.lora.flat)


@pytest.mark.parametrize("change, field", [
    ({}, "lora"),
    (dict(model=dict(init_seed=4)), "model.init_seed"),
    (dict(exact=True), "exact"),
    (dict(engine=dict(block_size=32)), "engine.block_size"),
])
def test_refused_by_file_and_field(tmp_path, change, field):
    a, _ = job(tmp_path, 0, "r")
    b, _ = job(tmp_path, 1, "r", **change)
    if field == "lora":
        b.lora = type(b.lora)()  # off: full fine-tuning
    with pytest.raises(ConfigError) as e:
        LoraHost([a, b], sources=["a.yaml", "b.yaml"])
    assert e.value.path == field and e.value.source == "b.yaml", str(e.value)


def test_refused_when_two_jobs_share_a_run_folder(tmp_path):
    a, _ = job(tmp_path, 0, "same")
    b, _ = job(tmp_path, 1, "x")
    b.log.out_dir = a.log.out_dir
    with pytest.raises(ConfigError, match=r"log.out_dir .* also a.yaml's"):
        LoraHost([a, b], sources=["a.yaml", "b.yaml"])


def test_hosted_job_resumes_from_its_checkpoint(tmp_path):
    straight = host_of(tmp_path, 2, "s", steps=4)
    straight.train()
    half = host_of(tmp_path, 2, "c", steps=2, checkpoint=dict(save_at_end=True))
    half.train()
    rest = host_of(tmp_path, 2, "c", steps=4, checkpoint=dict(resume="auto"))
    jobs = rest.train()
    assert [j.status for j in jobs] == [0, 0]
    for i, j in enumerate(jobs):
        assert j.trainer.resumed_from is not None and len(j.history) == 4
        assert torch.equal(j.trainer.model.lora.flat, straight.jobs[i].trainer.model.lora.flat), i


def test_cli_runs_several_configs_as_one_host(tmp_path, capsys):
    from rlcu.train.cli import main

    tok = syn.make_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(8, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")

    def write(name, **kw):
        cfg = {"model": {"tiny": dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id),
                         "tokenizer": str(tmp_path / "tok")},
               "data": {"path": str(tmp_path / "train.jsonl")}, "steps": 2, "prompts_per_step": 2, "group_size": 2,
               "max_new_tokens": 2, "rewards": [{"fn": "rlcu.data.synthetic:partial_match_reward"}],
               "lora": {"r": 4}, "log": {"out_dir": str(tmp_path / name), "progress": False, "plot": False,
                                         "tensorboard": False}}
        cfg.update(kw)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return str(tmp_path / f"{name}.yaml")

    a, b = write("a"), write("b", seed=7)
    assert main(["grpo", a, b]) == 0
    for name in ("a", "b"):
        assert (tmp_path / name / "adapter" / "adapter_model.safetensors").is_file()
    full = write("full", lora={"r": 0})
    capsys.readouterr()
    assert main(["grpo", a, full, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora must be set" in err[0] and "full.yaml" in err[0], err


def words_said(completions, **_):
    """The words of the model's turns (a conversation's) or of the completion: differs in a group."""
    return [float(sum(len(m["content"].split()) for m in c if m["role"] == "assistant")) if isinstance(c, list)
            else float(len(c.split())) for c in completions]


def test_hosted_multi_turn_jobs_equal_each_alone_exact_mode(tmp_path):
    """Two multi-turn jobs (support.episode_trainer's Again environment, each its own max_turns) and
    a single-turn one share a host: the episodes of both run in one run_episodes call per round
    (with their own limits), the completions in a generate call, and each job's adapter, losses
    and episode metrics are those of the job run alone, bit for bit."""
    from support.episode_trainer import chat_tokenizer

    tok = chat_tokenizer()
    eos = [tok.eos_token_id] + [tok.token_to_id(d) for d in syn.DIGITS]
    tiny = dict(TINY, vocab_size=tok.vocab_size, eos_token_id=eos, max_position_embeddings=96)
    env = {"environment": "support.episode_trainer:Again", "max_episode_tokens": 40}
    turns = {0: dict(multi_turn=dict(env, max_turns=3)), 1: dict(multi_turn=dict(env, max_turns=2)), 2: {}}

    def cfg(i, out):
        c, _ = job(tmp_path, i, out, steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3, exact=True,
                   model=dict(tiny=tiny), **turns[i])
        return c

    host = LoraHost([cfg(i, "mh") for i in range(3)], [ROWS] * 3, [[words_said]] * 3, tokenizers=[tok] * 3)
    jobs = host.train()
    assert [j.status for j in jobs] == [0, 0, 0]
    assert host.engine.generate_calls == 4  # two rounds, each a generate and a run_episodes call
    assert jobs[0].history[-1]["episodes/turns_max"] == 3 and jobs[1].history[-1]["episodes/turns_max"] == 2
    for i, j in enumerate(jobs):
        tr = GRPOTrainer(cfg(i, "malone"), ROWS, [words_said], tokenizer=tok)
        tr.train()
        assert torch.equal(j.trainer.model.lora.flat, tr.model.lora.flat), i
        keys = ("loss", "reward", "grad_norm", "episodes/turns", "episodes/turns_max")
        assert [[h.get(k) for k in keys] for h in j.history] == [[h.get(k) for k in keys] for h in tr.history], i


def test_a_job_joins_a_running_host_and_equals_itself_alone(tmp_path):
    """Job 1 joins the host while job 0 is stepping (queued from job 0's second reward call, taken
    between rounds): its adapter becomes an engine slot of its own, it runs its steps beside job
    0's, its on_end gets its status, and both jobs' adapters are bit for bit those of each run
    alone (exact mode). A join refused by check_jobs ends with status 2; once the host ended,
    join raises HostClosed."""
    from rlcu.train.lora_host import HostClosed

    small = dict(exact=True, prompts_per_step=2, group_size=2)
    a, tok = job(tmp_path, 0, "j", steps=3, **small)
    b, _ = job(tmp_path, 1, "j", steps=2, **small)
    bad, _ = job(tmp_path, 2, "j", steps=2)  # another exact mode: refused
    ended, calls = [], [0]

    def joining(*args, **kw):
        calls[0] += 1
        if calls[0] == 2:
            host.join(b, ROWS, [first_is_even], tokenizer=tok, name="b", on_end=ended.append)
            host.join(bad, ROWS, [first_is_even], tokenizer=tok, name="bad", on_end=ended.append)
        return first_is_even(*args, **kw)

    host = LoraHost([a], [ROWS], [[joining]], tokenizers=[tok], names=["a"])
    jobs = host.train()
    assert [j.name for j in jobs] == ["a", "b"] and [j.status for j in jobs] == [0, 0]
    assert sorted((j.name, j.status) for j in ended) == [("b", 0), ("bad", 2)]
    assert "exact" in str(next(j for j in ended if j.name == "bad").error)
    assert len(jobs[1].history) == 2 and jobs[1].trainer.model.flat.data_ptr() == host.base.flat.data_ptr()
    with pytest.raises(HostClosed):
        host.join(b, name="late")
    for i, j in enumerate(jobs):
        tr, _ = alone(tmp_path, i, steps=3 if i == 0 else 2, **small)
        assert torch.equal(j.trainer.model.lora.flat, tr.model.lora.flat), j.name
        assert losses(j.history) == losses(tr.history), j.name


def test_host_loads_a_tokenizer_once_and_times_its_phases(tmp_path):
    """Jobs naming one tokenizer folder share one load (a job whose folder holds none ends with
    status 2, the others go on); the timeline holds each build and one round per step plus the
    last (the final updates), each with every live job's turn."""
    syn.make_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "none").mkdir()
    cfgs = [job(tmp_path, i, "t", steps=2, model={"tokenizer": str(tmp_path / t)})[0]
            for i, t in enumerate(["tok", "tok", "none"])]
    host = LoraHost(cfgs, [ROWS] * 3, [[first_is_even]] * 3)
    a, b, bad = host.jobs
    assert a.trainer.tokenizer is b.trainer.tokenizer and bad.trainer is None and bad.status == 2
    assert "tokenizer.json" in str(bad.error) and not a.trainer.give_back_memory and not b.trainer.give_back_memory
    host.train()
    assert [j.status for j in host.jobs] == [0, 0, 2]
    tl = host.timeline
    assert set(tl["builds_s"]) == {"job0", "job1", "job2"} and tl["base_s"] >= 0 and tl["engine_start_s"] >= 0
    assert len(tl["rounds"]) == 3 and all(set(r["turns_s"]) == {"job0", "job1"} for r in tl["rounds"])
