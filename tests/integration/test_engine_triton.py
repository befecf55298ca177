"""The engine through every Triton kernel (embedding, RMSNorm, RoPE, SwiGLU, KV write, paged
attention, sampler) equals the engine on the twins: on the CPU through TRITON_INTERPRET=1,
on a GPU natively. Catches what the kernels' own tests cannot: the engine's packed views,
strided V, int32 buffers at odd offsets, chunked prefill mixed with decode, fork + COW."""

import os

import pytest
import torch
from support.hf_util import make_hf_model

import rlcu.ops.paged_attention as pa
from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams
from rlcu.ops.decode_linear import CONFIGS as DL_CONFIGS

# conftest.py sets TRITON_INTERPRET=1 without a GPU (before triton is imported) and patches
# the interpreter for numpy >= 2.4
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


LIST = dict(kernel="list", BN=16, min_part=16, units_per_sm=1)  # chunks of 16 keys: contexts split
VARIANTS = {  # name: (decode_linear on, decode_plan overrides)
    "split": (False, dict(kernel="split")),
    "list": (False, LIST),  # the default decode kernel
    "decode_linear+list": (True, LIST),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_on_kernels_equals_twins(tmp_path, monkeypatch, variant):
    # decode_linear: the decode steps' projections through ops/decode_linear.py and
    # ops/decode_qkv.py; list: the decode attention's list kernel (ops/paged_decode_list.py)
    fused, plan = VARIANTS[variant]
    decode = plan["kernel"]
    monkeypatch.setitem(DL_CONFIGS, "enabled", fused)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"], **plan})
    built, calls = [], []  # the work lists the engine built, and the work each list-kernel call got
    work_cls, launch = pa.DecodeWork, pa.decode_list
    monkeypatch.setattr(pa, "DecodeWork", lambda *a: built.append(work_cls(*a)) or built[-1])
    monkeypatch.setattr(pa, "decode_list", lambda *a: calls.append(a[-1]) or launch(*a))
    try:
        _, folder = make_hf_model(tmp_path)
        m = Qwen3.from_pretrained(folder, device="cuda" if torch.cuda.is_available() else "cpu")
        prompts = [{"prompt_token_ids": p} for p in ([5, 17, 3, 9, 11], list(range(40, 61)))]
        sp = SamplingParams(n=2, temperature=0.8, max_tokens=4, ignore_eos=True, seed=3, logprobs=True)
        outs = {}
        for backend in ("torch", "triton"):
            monkeypatch.setenv("RLCU_BACKEND", backend)
            llm = LLM(m, num_kv_blocks=16, block_size=4, max_num_batched_tokens=12, enforce_eager=True)
            outs[backend] = llm.generate(prompts, sp, use_tqdm=False)
        for a, b in zip(outs["torch"], outs["triton"]):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < (1e-5 if INTERPRET else 1e-3)
        if decode == "list":  # the decode steps ran the list kernel, each layer on its step's one work list
            assert built and calls and all(w is not None for w in calls)
            assert len(calls) == m.cfg.num_hidden_layers * len(built)
            assert any(int(w.meta[1]) > w.S for w in built)  # some steps split a sequence: the combine ran
    finally:
        torch.set_num_threads(n)


pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
