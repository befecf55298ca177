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


def test_exact_engine_with_expert_adapters_equals_trainer(pair):
    """LoRA on the attention, the experts and the router in the engine on the GPU (the decode graphs,
    chunked prefill, one adapter read in place beside base requests in the same batch): exact mode's
    logprobs equal the trainer's forward with the adapter for its requests and without it for the
    base's, bit for bit."""
    from rlcu.model.lora import LoraAdapters, LoraConfig

    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, exact=True)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]
    ad = LoraAdapters.create(m.cfg, LoraConfig(r=5, alpha=7, target_modules=names), m.device, m.dtype)
    g = torch.Generator().manual_seed(3)
    ad.flat.copy_((torch.randn(ad.flat.shape, generator=g) * 0.05).to(ad.flat.device, ad.flat.dtype))
    ad.attach(m)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (int(L),), generator=g).tolist()
               for L in torch.randint(5, 90, (8,), generator=g)]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=32, ignore_eos=True, seed=5, logprobs=True)
    llm = LLM(m, num_kv_blocks=512, max_num_batched_tokens=64)
    which = [("model", "base")[j % 2] for j in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora=which)
    assert llm.runner.use_graphs
    for p, name, o in zip(prompts, which, outs):
        m.lora = ad if name == "model" else None
        assert_engine_is_trainer(m, [(p, c.token_ids, c.logprobs) for c in o.outputs], sp.temperature)
