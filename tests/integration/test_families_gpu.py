"""The families beside Qwen3 (Qwen2 with its q/k/v bias, Llama untied and tied, Llama 3.1's rope,
Qwen2.5's YaRN, Mistral) through the native Triton kernels on the GPU, in bf16, at small odd
shapes: logits against HF transformers in fp32 on the same weights, the engine's greedy tokens
(CUDA graphs) against the trainer's argmax continuation, and exact mode's engine logprobs equal to
the trainer's bit for bit (decode graphs, chunked prefill, n = 4)."""

import pytest
import torch
from support.exact_util import assert_engine_is_trainer, sample
from support.hf_util import FAMILY_CASES, make_family_model

import rlcu
from rlcu.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
SHAPE = dict(vocab_size=1000, hidden_size=320, intermediate_size=704, num_hidden_layers=3, num_attention_heads=5,
             num_key_value_heads=1, head_dim=64)


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def pair(request, tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("families_gpu"), request.param, seed=3, **SHAPE)


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE["vocab_size"], (int(L),), generator=g).tolist()
            for L in torch.randint(5, 90, (n,), generator=g)]


def test_logits_match_hf_in_bf16(pair):
    hf, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, SHAPE["vocab_size"], (2, 77))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = m.logits(ids.cuda()).float().cpu()
    err = (got - ref).norm() / ref.norm()
    assert err < 2e-2, float(err)


def test_engine_greedy_is_the_trainers_argmax(pair):
    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, exact=True)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()
    outs = LLM(m, num_kv_blocks=256).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        seq = p + o.outputs[0].token_ids
        logits = m.logits(torch.tensor([seq], device="cuda"))[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == o.outputs[0].token_ids


def test_exact_engine_equals_trainer_bit_for_bit(pair):
    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, exact=True)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=11, logprobs=True)
    prompts = _prompts(8, seed=1)
    llm = LLM(m, num_kv_blocks=512, max_num_batched_tokens=64)  # prefills in chunks; decode graphs
    gens = sample(llm, prompts, sp)
    assert_engine_is_trainer(m, gens, sp.temperature)
