"""CPU threads per process (rlcu.threads): the count follows the cores the process may use
(affinity, cgroup quota, torchrun's local ranks, a scheduled job's CPU slots), an explicit
OMP_NUM_THREADS or model.threads wins, the command lines set it before any work, and a CPU
run records it, so that a resume with another count is a config change."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from support.run_util import TINY, TOK

from rlcu import threads as th
from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("keep_threads")  # tests/conftest.py


# ---------------------------------------------------------------- the choice
def test_choice_follows_the_cores_ranks_and_slots(monkeypatch):
    monkeypatch.setattr(th, "available_cores", lambda: 8)
    assert th.choose("auto", env={})[0] == 8
    assert th.choose("auto", env={"LOCAL_WORLD_SIZE": "4"})[0] == 2  # torchrun's ranks on this node share them
    assert th.choose("auto", share=0.25, env={})[0] == 2  # one of four CPU slots
    assert th.choose("auto", share=1 / 3, env={"LOCAL_WORLD_SIZE": "4"})[0] == 1  # never 0
    n, why = th.choose("auto", env={"OMP_NUM_THREADS": "3"})
    assert (n, why) == (3, "OMP_NUM_THREADS")  # an explicit choice wins over auto
    assert th.choose(5, env={"OMP_NUM_THREADS": "3"}) == (5, "model.threads")  # and the config over both
    assert "8 cores available / 4 local ranks" in th.choose("auto", env={"LOCAL_WORLD_SIZE": "4"})[1]
    for bad in ("0", "many", -1, True):
        with pytest.raises(ValueError, match="model.threads must be 'auto' or a number"):
            th.choose(bad, env={})
    # other processes busy on some cores: auto takes the idle ones (a spinning thread without a
    # core of its own stalls every op)
    monkeypatch.setattr(th, "idle_cores", lambda: 1.1)
    assert th.choose("auto", env={}) == (1, "auto: 8 cores available, 1.1 idle")
    monkeypatch.setattr(th, "idle_cores", lambda: 7.8)
    assert th.choose("auto", env={})[0] == 8
    monkeypatch.setattr(th, "idle_cores", lambda: 0.0)
    assert th.choose("auto", env={"LOCAL_WORLD_SIZE": "2"})[0] == 1


def test_idle_cores_from_proc_stat():
    a = "cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 100 0 0 1000 0 0 0 0 0 0\ncpu1 100 0 0 1000 0 0 0 0 0 0\nintr 5\n"
    # cpu0 busy for 100 ticks; cpu1 idle for 90 and waiting on I/O for 10
    b = "cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 200 0 0 1000 0 0 0 0 0 0\ncpu1 100 0 0 1090 10 0 0 0 0 0\nintr 9\n"
    assert th.idle_between(a, b, {0, 1}) == 1.0
    assert th.idle_between(a, b, {1}) == 1.0 and th.idle_between(a, b, {0}) == 0.0
    assert th.idle_between(a, b, {5}) is None


def test_cgroup_quota_and_physical_cores(tmp_path):
    root = tmp_path / "cg"
    (root / "jobs" / "a").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "jobs" / "cpu.max").write_text("300000 100000\n")  # a parent's limit applies to its children
    (root / "jobs" / "a" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/jobs/a\n")
    assert th.cgroup_cpus(root, proc) == 3.0
    (root / "jobs" / "a" / "cpu.max").write_text("150000 100000\n")
    assert th.cgroup_cpus(root, proc) == 1.5
    proc.write_text("0::/\n")
    assert th.cgroup_cpus(root, proc) is None  # the root's `max`: no limit
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:cpu,cpuacct:/\n3:memory:/\n")
    assert th.cgroup_cpus(v1, proc) == 2.0
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert th.cgroup_cpus(v1, proc) is None
    sysfs = tmp_path / "cpu"
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):  # two cores, two hyper-threads each
        top = sysfs / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text("0\n")
        (top / "core_id").write_text(f"{core}\n")
    assert th.physical_cores([0, 1, 2, 3], sysfs) == 2
    assert th.physical_cores([0, 2], sysfs) == 1
    assert th.physical_cores([0, 9], sysfs) == 2  # unreadable topology: the logical count
    assert th.available_cores() >= 1


def test_apply_sets_torch_and_describes_why(monkeypatch):
    monkeypatch.setattr(th, "available_cores", lambda: 1)
    assert th.apply("auto") == 1 == torch.get_num_threads()
    assert th.describe() == "CPU threads: 1 (auto: 1 cores available)"
    assert th.apply(2) == 2 == torch.get_num_threads()
    torch.set_num_threads(1)
    assert th.describe() == "CPU threads: 1 (as the process had them)"


# ---------------------------------------------------------------- the command line and the record
def _cli_config(tmp_path, **kw):
    TOK.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(12, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")
    cfg = dict(model=dict(tiny=dict(TINY), tokenizer=str(tmp_path / "tok"), device="cpu"), steps=1,
               prompts_per_step=2, group_size=2, max_new_tokens=3, chat_template=False,
               rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}],
               data=dict(path=str(tmp_path / "train.jsonl")),
               log=dict(out_dir=str(tmp_path / "out"), progress=False, tensorboard=False, plot=False))
    cfg.update(kw)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run.yaml"


def test_cli_sets_threads_from_the_cores_and_records_them(tmp_path, monkeypatch):
    """`rlcu grpo` on a machine whose process may use one core runs on one thread (torch's
    default counts the machine's), and the run's config and checkpoint say so."""
    from rlcu.train import cli

    y = _cli_config(tmp_path)
    monkeypatch.setattr(th, "available_cores", lambda: 1)
    torch.set_num_threads(2)  # torch's default on this machine, whatever the process may use
    assert cli.main(["grpo", str(y)]) == 0
    assert torch.get_num_threads() == 1
    out = tmp_path / "out"
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["threads"] == 1
    (ck,) = (out / "checkpoints").glob("step-*")
    assert json.loads((ck / "trainer_state.json").read_text())["config"]["model"]["threads"] == 1
    assert "CPU threads: 1 (auto: 1 cores available)" in (out / "log.txt").read_text()


def test_resume_keeps_the_thread_count_and_refuses_another(tmp_path, monkeypatch, capsys):
    """A CPU checkpoint made on 1 thread resumes on 1 under auto where auto alone would choose 2
    (the run goes on exactly); a resume given 2 is refused with one line naming model.threads
    and the count to give."""
    from rlcu.train import cli

    y = _cli_config(tmp_path, steps=3, checkpoint=dict(every=1, keep_last=0))
    monkeypatch.setattr(th, "available_cores", lambda: 1)
    assert cli.main(["grpo", str(y), "--set", "steps=1"]) == 0
    monkeypatch.setattr(th, "available_cores", lambda: 2)  # resumed where the process may use 2 cores
    capsys.readouterr()
    assert cli.main(["grpo", str(y), "--resume", "auto", "--set", "model.threads=2"]) == 2
    err = capsys.readouterr().err
    assert "model.threads: 1 -> 2" in err and "--set model.threads=1" in err and len(err.splitlines()) == 1
    assert cli.main(["grpo", str(y), "--resume", "auto", "--set", "steps=2"]) == 0
    assert torch.get_num_threads() == 1
    out = tmp_path / "out"
    assert "CPU threads: 1, as the run of step-000001 used (model.threads: auto" in (out / "log.txt").read_text()
    (ck,) = (out / "checkpoints").glob("step-000002")
    assert json.loads((ck / "trainer_state.json").read_text())["config"]["model"]["threads"] == 1
    assert cli.main(["grpo", str(y), "--resume", "auto", "--set", "model.threads=1"]) == 0  # given: the same
    assert len(list((out / "checkpoints").glob("step-*"))) == 3


def test_generate_chooses_its_threads(tmp_path, monkeypatch, capsys):
    """`rlcu generate` too: --threads N, or auto as the trainers choose."""
    from rlcu.engine import cli as gen

    assert gen.main(["--threads", "0"]) == 2
    assert capsys.readouterr().err == "rlcu generate: --threads must be 'auto' or a number of threads >= 1, got '0'\n"
    monkeypatch.setattr(th, "available_cores", lambda: 1)
    torch.set_num_threads(2)
    assert gen.main(["--max-tokens", "2", "--output", str(tmp_path / "o.jsonl"), "--no-progress"]) == 0
    assert torch.get_num_threads() == 1
