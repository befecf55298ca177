"""The families beside Qwen3 (Qwen2, Llama untied and tied, Mistral) end to end on the CPU: the
engine's greedy tokens against HF transformers' `generate`, exact mode's engine logprobs equal to
the trainer's forward bit for bit, the engine through the Triton kernels (interpreted) equal to the
twins (decode_qkv's fused schedule too), and `rlcu generate --model FOLDER`."""


import pytest
import torch
from support.engine_util import GREEDY, PROMPTS, assert_kernels_equal_twins
from support.exact_util import assert_engine_is_trainer, sample
from support.hf_util import FAMILY_CASES, make_family_model

import rlcu
from rlcu.engine import LLM, SamplingParams
from rlcu.ops.decode_linear import CONFIGS as DL_CONFIGS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def pair(request, tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("families"), request.param, seed=len(request.param))


def _toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("engine", [dict(num_kv_blocks=64), dict(num_kv_blocks=80, block_size=4,
                                                                   max_num_batched_tokens=7)],
                         ids=["plain", "chunked"])
def test_greedy_matches_hf_generate(pair, engine):
    hf, folder = pair
    llm = LLM(rlcu.from_pretrained(folder), enforce_eager=True, **engine)
    outs = llm.generate(_toks(PROMPTS), GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref


def test_exact_engine_equals_trainer_bit_for_bit(pair):
    _, folder = pair
    m = rlcu.from_pretrained(folder, exact=True)
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=6, ignore_eos=True, seed=11, logprobs=True)
    llm = LLM(m, enforce_eager=True, num_kv_blocks=80, block_size=4, max_num_batched_tokens=7)
    assert_engine_is_trainer(m, sample(llm, PROMPTS, sp), sp.temperature)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "decode_qkv"])
def test_engine_on_kernels_equals_twins(pair, monkeypatch, fused):
    """fused: the decode steps' input norm, QKV GEMM (+ bias) and rope (+ q/k norm) in decode_qkv."""
    import rlcu.engine.paged_forward as pf

    monkeypatch.setitem(DL_CONFIGS, "enabled", fused)
    calls, decode_qkv = [], pf.decode_qkv
    monkeypatch.setattr(pf, "decode_qkv", lambda *a, **k: calls.append(k.get("bias")) or decode_qkv(*a, **k))
    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda" if torch.cuda.is_available() else "cpu")
    assert_kernels_equal_twins(m, monkeypatch)
    assert bool(calls) == fused and all((b is not None) == m.cfg.fam.qkv_bias for b in calls)


def test_rlcu_generate_takes_the_folder(pair, tmp_path):
    """`rlcu generate --model FOLDER` picks the family from config.json: greedy tokens as HF's."""
    import json

    from rlcu.engine.cli import main

    hf, folder = pair
    prompt = PROMPTS[1]
    inp, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    assert main(["generate", "--model", str(folder), "--input", str(inp), "--output", str(out), "--max-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--no-progress", "--num-kv-blocks", "16", "--dtype", "float32",
                 "--enforce-eager"]) == 0
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert json.loads(out.read_text())["outputs"][0]["token_ids"] == ref.tolist()
