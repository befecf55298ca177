"""Exact mode through the Triton kernels (the batch-invariant GEMM, the exact attention over
packed and paged K/V, the head kernel with per-row temperatures): on the CPU under
TRITON_INTERPRET=1 at tiny shapes, natively on a GPU. The engine's sampled-token logprobs
(chunked prefill mixed with decode, n = 2 forks) equal the model's forward bit for bit, for Qwen3,
Qwen2 (q/k/v bias) and Llama 3.1 (no q/k norm, llama3 rope), and a request generated alone gives
the same tokens and bits as in the batch.

Under the interpreter tl.dot is numpy's matmul, which gives a row other bits at another row of
the tile; the kernels then take the dot as an ordered sum (matmul_invariant.dot_invariant), so
this test checks the kernels' tiling, masks and orders, and the GPU test the tensor cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.exact_util import attention_chunks_check, mm_rows_check, tiny_model

from rlcu.engine import LLM, SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]

SHAPE = {"vocab_size": 67, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
         "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}


FAMILIES = {"qwen3": {}, "qwen2": {"family": "qwen2"},  # Qwen2: q/k/v bias, no q/k norm
            "llama3.1": {"family": "llama", "rope": {"type": "llama3", "theta": 10000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16}}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_on_exact_kernels_equals_forward(monkeypatch, family):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    m = tiny_model("cuda" if torch.cuda.is_available() else "cpu", exact=True, **SHAPE, **FAMILIES[family])
    prompts = [[5, 17, 3, 9, 11], list(range(20, 33))]
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=3, ignore_eos=True, seed=3, logprobs=True)

    def gen(ps):
        llm = LLM(m, num_kv_blocks=16, block_size=4, max_num_batched_tokens=8, enforce_eager=True)
        return [(c.token_ids, c.logprobs) for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                                  use_tqdm=False) for c in o.outputs]

    gens = gen(prompts)
    seqs = [p + t for p, (t, _) in zip([p for p in prompts for _ in range(2)], gens)]
    tokens = torch.tensor([x for s in seqs for x in s], device=m.device)
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), device=m.device,
                      dtype=torch.int32)
    lp = m.forward(tokens, cu, temperature=0.8, grad=False).cpu()
    for k, (p, (t, lps)) in enumerate(zip([p for p in prompts for _ in range(2)], gens)):
        s = int(cu[k]) + len(p)
        assert torch.equal(torch.tensor(lps), lp[s:s + len(t)]), k
    assert gen(prompts[:1]) == gens[:2]  # the first request alone


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU tensors through the interpreter (the GPU test covers the device)")
def test_exact_kernels_rows_do_not_depend_on_the_batch(monkeypatch):
    """The GEMM kernel (K = 37: a masked last K tile; rows at other offsets of the tile) and the
    attention kernel (packed training rows = paged decode rows = a paged prefill chunk)."""
    from rlcu.ops import attention_exact as ae
    from rlcu.ops._backend import backend_name

    monkeypatch.setenv("RLCU_BACKEND", "triton")
    assert backend_name("cpu") == "triton"  # the checks below run the kernels, not the twins
    launches = []
    launch = ae._launch
    monkeypatch.setattr(ae, "_launch", lambda *a: (launches.append(a[10]), launch(*a))[1])
    mm_rows_check()
    attention_chunks_check()
    assert False in launches and True in launches  # both the packed and the paged variants ran


def _has_ptxas() -> bool:
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_ptxas(), reason="needs Triton's NVIDIA backend (its ptxas)")
def test_exact_kernels_compile_one_float_path_for_sm90():
    """Compiled for sm_90 with no GPU (tests/support/exact_ptx.py, in a process without the
    interpreter): the exact attention's packed (training) and paged (engine) variants have the
    same float instructions line by line (FMA contraction included), and the head kernel's lse
    and lp lines are the same with and without the entropy (GRPO's fused head vs the sampler)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parents[1] / "support"
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), str(here), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(here / "exact_ptx.py")], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["attention_equal"] and r["attention_lines"] > 5, r
    assert r["head_lines"] > 5 and r["head_own_file"] and not r["head_differs"] and not r["head_not_within"], r
