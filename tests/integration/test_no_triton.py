"""The PyTorch twins on a machine where `import triton` fails: every op module imports (its
kernels define against a stand-in, ops/_backend.py), a model's forward and backward and an
engine's generate run, and a kernel launch says why it cannot run. A fresh process with a
meta-path hook that refuses triton (the package is installed here)."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = r"""
import importlib, pkgutil, sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (refused by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
for m in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[m]

import torch
import rlcu.ops
from rlcu.ops import _backend
assert not _backend.HAS_TRITON and _backend.backend_name("cuda") == "torch"
for mod in pkgutil.iter_modules(rlcu.ops.__path__):
    importlib.import_module(f"rlcu.ops.{mod.name}")
from rlcu import Qwen3, Qwen3Config
from rlcu.engine import LLM, SamplingParams
from rlcu.ops.rmsnorm import _rmsnorm_fwd_kernel

try:
    _rmsnorm_fwd_kernel[(1,)]()
    raise SystemExit("a kernel launched without triton")
except RuntimeError as e:
    assert "triton package cannot be imported" in str(e), e

torch.set_num_threads(1)
cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, bos_token_id=None, eos_token_id=63)
m = Qwen3.from_config(cfg, seed=1, init_std=0.2)
tokens = torch.randint(0, 64, (12,))
cu = torch.tensor([0, 5, 12], dtype=torch.int32)
lp = m.forward(tokens, cu)
m.backward(torch.ones_like(lp))  # the training ops' twins too
assert torch.isfinite(lp).all() and torch.isfinite(m.grad_flat).all() and m.grad_flat.abs().sum() > 0
outs = LLM(m, num_kv_blocks=32, block_size=4).generate(
    [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=5, seed=0, ignore_eos=True, logprobs=True), use_tqdm=False)
assert [len(c.token_ids) for o in outs for c in o.outputs] == [5, 5, 5, 5]
assert "triton" not in sys.modules
print("ok")
"""


def test_twins_without_triton():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RLCU_BACKEND", None)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("ok")
