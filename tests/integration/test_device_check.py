"""A device this machine lacks (`cuda` without CUDA, `cuda:3` with fewer GPUs) is one line and
exit status 2 at every entry point that takes one: the trainers' model.device, `rlcu
generate --device`, the demo, the scheduler's job, bench/learning.py, and torchrun with more
ranks than GPUs; not torch's traceback ending in 'Torch not compiled with CUDA enabled'.
CUDA's presence is monkeypatched, so the tests mean the same on a machine with GPUs."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from support.run_util import TINY, TOK

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this machine has n CUDA devices, as far as rlcu can tell (0: none)."""

    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return have


def one_line(capsys, *want) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in want:
        assert w in err, err
    return err


def test_check_device(gpus):
    from rlcu.config import ConfigError, check_device

    gpus(0)
    assert check_device("cpu", "model.device") == "cpu"
    with pytest.raises(ConfigError, match=r"^model.device is 'cuda', but .*: use cpu$"):
        check_device("cuda", "model.device")
    for bad in ("mps", "gpu", "cuda:x"):
        with pytest.raises(ConfigError, match=r"--device must be cpu, cuda or cuda:N"):
            check_device(bad, "--device")
    gpus(2)
    assert check_device("cuda", "d") == "cuda" and check_device("cuda:1", "d") == "cuda:1"
    with pytest.raises(ConfigError, match=r"is 'cuda:3', but this machine has 2 CUDA device\(s\): cuda:0 to cuda:1"):
        check_device("cuda:3", "--device")


def run_yaml(tmp_path, kind: str) -> str:
    TOK.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(8, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")
    cfg = {"model": {"tiny": dict(TINY), "tokenizer": str(tmp_path / "tok"), "device": "cuda"},
           "data": {"path": str(tmp_path / "train.jsonl")}, "steps": 1,
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "plot": False, "tensorboard": False}}
    if kind != "sft":
        cfg.update(prompts_per_step=2, group_size=1 if kind == "ppo" else 2, max_new_tokens=2,
                   rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "run.yaml")


@pytest.mark.parametrize("kind", ["sft", "grpo", "ppo"])
def test_trainers_model_device_cuda_without_cuda(tmp_path, capsys, gpus, kind):
    from rlcu.train.cli import main

    gpus(0)
    assert main([kind, run_yaml(tmp_path, kind)]) == 2
    one_line(capsys, f"rlcu {kind}: model.device is 'cuda', but ")
    assert not (tmp_path / "out").exists()


def test_generate_device_this_machine_lacks(capsys, gpus):
    from rlcu.engine.cli import main

    gpus(0)
    assert main(["generate", "--device", "cuda", "--no-progress"]) == 2
    one_line(capsys, "rlcu generate: --device is 'cuda', but ")
    gpus(2)
    assert main(["generate", "--device", "cuda:3", "--no-progress"]) == 2
    one_line(capsys, "--device is 'cuda:3', but this machine has 2 CUDA device(s)")


def test_demo_device_cuda_without_cuda(tmp_path, capsys, gpus):
    from rlcu.cli import main

    gpus(0)
    assert main(["demo", "--out", str(tmp_path / "demo"), "--set", "device=cuda", "--no-progress"]) == 2
    one_line(capsys, "rlcu demo: device is 'cuda', but ")
    assert not (tmp_path / "demo").exists()


def test_scheduled_job_device_cuda_without_cuda(tmp_path, capsys, gpus):
    from rlcu.sched.job import run_grpo_exit_code

    gpus(0)
    # refused before the scheduler is asked for anything (there is none at this address)
    assert run_grpo_exit_code("rlcu sched job", run_yaml(tmp_path, "grpo"), f"unix:{tmp_path / 'none.sock'}") == 2
    one_line(capsys, "rlcu sched job: model.device is 'cuda', but ")


def test_bench_learning_device_cuda_without_cuda(capsys, gpus):
    from bench import learning

    gpus(0)
    with pytest.raises(SystemExit) as ei:
        learning._args(["--device", "cuda", "--quick"])
    assert ei.value.code == 2
    one_line(capsys, "--device is 'cuda', but ")


def test_torchrun_with_more_ranks_than_gpus(monkeypatch, capsys, gpus):
    from rlcu.__main__ import main

    gpus(1)
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500", RLCU_DIST_BACKEND="nccl").items():
        monkeypatch.setenv(k, v)
    assert main(["info"]) == 2
    one_line(capsys, "LOCAL_RANK=1 but this node has 1 GPUs")
