"""Checkpoints: round trip of weights / optimizer / RNG / trainer state, pruning, resume
resolution, and a save killed midway leaving the previous checkpoint loadable."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import rlcu
from rlcu.config import ModelConfig, OptimConfig
from rlcu.optim import FlatAdamW
from rlcu.train.checkpoint import build_model, latest_checkpoint, load_checkpoint, resolve_resume, save_checkpoint

TINY = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny(seed=0, dtype=torch.float32):
    return rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), dtype=dtype, seed=seed)


def _train(model, opt, n=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        model.zero_grad()
        for v in model.grads.values():  # every parameter; the layout's alignment padding keeps 0
            v.copy_(torch.randn(v.shape, generator=g))
        opt.step(1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(tmp_path, dtype):
    m = tiny(dtype=dtype)
    opt = FlatAdamW(m, OptimConfig(lr=1e-2))
    _train(m, opt)
    g = torch.Generator().manual_seed(3)
    random.seed(11)
    torch.manual_seed(12)
    p = save_checkpoint(tmp_path, 2, m, opt, {"data": {"epoch": 1, "cursor": 5}}, keep_last=2, generators={"g": g})
    assert p.name == "step-000002" and (p / "model" / "config.json").exists() and (p / "optim.pt").exists()
    want = (random.random(), torch.rand(3), torch.rand(2, generator=g))
    m2 = tiny(seed=9, dtype=dtype)
    opt2 = FlatAdamW(m2, OptimConfig(lr=1e-2))
    g2 = torch.Generator().manual_seed(99)
    state = load_checkpoint(p, m2, opt2, generators={"g": g2})
    assert state == {"data": {"epoch": 1, "cursor": 5}, "step": 2}
    assert torch.equal(m2.flat, m.flat)
    for a, b in ((opt2.m, opt.m), (opt2.v, opt.v), (opt2.master, opt.master)):
        assert torch.equal(a, b)
    assert opt2.step_count == opt.step_count == 2
    got = (random.random(), torch.rand(3), torch.rand(2, generator=g2))
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # the model folder is a plain HF folder
    m3 = rlcu.Qwen3.from_pretrained(p / "model", dtype=dtype)
    assert torch.equal(m3.flat, m.flat)


def test_keep_last_and_latest(tmp_path):
    m = tiny()
    opt = FlatAdamW(m, OptimConfig())
    assert latest_checkpoint(tmp_path) is None and resolve_resume("auto", tmp_path) is None
    for s in (3, 6, 9, 12):
        save_checkpoint(tmp_path, s, m, opt, {}, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000009", "step-000012"]
    (tmp_path / ".tmp-step-000015-1").mkdir()  # a killed save: ignored, then cleaned up
    (tmp_path / "step-000099").mkdir()  # no trainer_state.json: not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step-000012"
    assert resolve_resume("auto", tmp_path).name == "step-000012"
    assert resolve_resume(str(tmp_path), tmp_path).name == "step-000012"
    assert resolve_resume(str(tmp_path / "step-000009"), tmp_path).name == "step-000009"
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    save_checkpoint(tmp_path, 12, m, opt, {"again": 1}, keep_last=0)  # re-saving a step replaces it
    assert not (tmp_path / ".tmp-step-000015-1").exists()
    assert json.loads((tmp_path / "step-000012" / "trainer_state.json").read_text())["again"] == 1
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, 13, m, opt, {"t": torch.zeros(1)}, keep_last=0)
    assert latest_checkpoint(tmp_path).name == "step-000012"
    # a save killed between moving an old step-12 aside and renaming the new one in
    (tmp_path / "step-000012").rename(tmp_path / ".tmp-old-step-000012-777")
    assert resolve_resume("auto", tmp_path).name == "step-000012"


def test_load_wrong_model(tmp_path):
    p = save_checkpoint(tmp_path, 1, tiny(), None, {}, keep_last=1)
    other = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**{**TINY, "vocab_size": 70}))
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(p, other, None)
    with pytest.raises(FileNotFoundError, match="no optim.pt"):
        load_checkpoint(p, tiny(), FlatAdamW(tiny(), OptimConfig()))


def test_build_model():
    m = build_model(ModelConfig(tiny=TINY, device="cpu", dtype="float32", init_seed=4, gradient_checkpointing=False))
    assert torch.equal(m.flat, tiny(seed=4).flat) and m.gradient_checkpointing is False
    from rlcu.config import ConfigError

    with pytest.raises(ConfigError, match="model.tiny.hidden is not a Qwen3Config field"):
        build_model(ModelConfig(tiny={"hidden": 3}))
    with pytest.raises(ConfigError, match="model.path must be set"):
        build_model(ModelConfig())


_CHILD = textwrap.dedent("""
    import os, sys, torch, rlcu
    from rlcu.config import OptimConfig
    from rlcu.train.checkpoint import save_checkpoint
    from rlcu.optim import FlatAdamW
    root = sys.argv[1]
    cfg = rlcu.Qwen3Config(**{tiny})
    m = rlcu.Qwen3.from_config(cfg, seed=0)
    opt = FlatAdamW(m, OptimConfig())
    save_checkpoint(root, 1, m, opt, {{"n": 1}}, keep_last=1)
    m.flat.add_(1.0)
    os.environ["RLCU_CHECKPOINT_TEST_SLEEP"] = "60"
    print("saving", flush=True)
    save_checkpoint(root, 2, m, opt, {{"n": 2}}, keep_last=1)  # killed while sleeping between files
""")


def test_kill_during_save(tmp_path):
    root = tmp_path / "ck"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tiny=repr(TINY)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"saving"
        deadline = time.time() + 60
        # wait until the second save has written its model folder into the temp folder
        while not any((p / "model" / "model.safetensors").exists() for p in root.glob(".tmp-step-000002-*")):
            assert time.time() < deadline and proc.poll() is None, "the child never reached the save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    last = latest_checkpoint(root)
    assert last.name == "step-000001"
    m = tiny(seed=5)
    opt = FlatAdamW(m, OptimConfig())
    assert load_checkpoint(last, m, opt)["n"] == 1
    assert torch.equal(m.flat, tiny(seed=0).flat)
    # the next save cleans the leftovers up
    save_checkpoint(root, 3, m, opt, {}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]
