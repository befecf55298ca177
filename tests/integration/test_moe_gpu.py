"""Qwen3-MoE through the native Triton kernels on the GPU, in bf16, at a small odd shape (7
experts, top 3, a dense layer): logits against transformers in fp32 on the same weights, and
exact mode's engine logprobs (decode graphs, chunked prefill, n = 4) equal to the trainer's bit
for bit."""

import pytest
import torch
from support.exact_util import assert_engine_is_trainer, sample
from support.hf_util import make_moe_model

import rlcu
from rlcu.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
SHAPE = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=192, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=7, num_experts_per_tok=3,
             mlp_only_layers=[1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("moe_gpu"), seed=4, **SHAPE)


def test_logits_match_hf_in_bf16(pair):
    hf, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, SHAPE["vocab_size"], (2, 61))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = m.logits(ids.cuda()).float().cpu()
    err = (got - ref).norm() / ref.norm()
    assert err < 3e-2, float(err)  # bf16, and a near-tie in the router may pick another expert


def test_exact_engine_equals_trainer_bit_for_bit(pair):
    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, exact=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (int(L),), generator=g).tolist()
               for L in torch.randint(5, 90, (8,), generator=g)]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=11, logprobs=True)
    llm = LLM(m, num_kv_blocks=512, max_num_batched_tokens=64)
    gens = sample(llm, prompts, sp)
    assert llm.runner.use_graphs
    assert_engine_is_trainer(m, gens, sp.temperature)
