"""The engine with LoRA adapters on the Triton kernels (the grouped lora_shrink / lora_expand of
ops/lora.py among the exact mode's kernels): under TRITON_INTERPRET=1 on the CPU at a tiny shape,
natively on a GPU. A batch mixing two adapters of different ranks and target sets (one slab,
zero-padded) and the base: each sequence's sampled-token logprobs equal the trainer's forward
with its adapter attached bit for bit, and a request alone gives the same tokens and bits."""

import pytest
import torch
from support.exact_util import tiny_model
from support.interp_util import needs_triton

from rlcu.engine import LLM, SamplingParams
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.ops._backend import backend_name
from rlcu.ops.lora import _shrink_kernel

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]

SHAPE = {"vocab_size": 67, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
         "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}


def _adapter(m, cfg, seed):
    ad = LoraAdapters.create(m.cfg, cfg, m.device, m.dtype)
    g = torch.Generator().manual_seed(seed)
    ad.flat.copy_((torch.randn(ad.flat.shape, generator=g) * 0.3).to(ad.flat.device))
    return ad


@needs_triton(_shrink_kernel)
def test_engine_with_adapters_on_exact_kernels_equals_forward(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    m = tiny_model("cuda" if torch.cuda.is_available() else "cpu", exact=True, **SHAPE)
    assert backend_name(m.device.type) == "triton"  # the kernels run, not the twins
    ads = {"qv": _adapter(m, LoraConfig(r=3, alpha=5, target_modules=["q_proj", "v_proj"]), 1),
           "all": _adapter(m, LoraConfig(r=4, alpha=7, target_modules="all-linear"), 2)}
    prompts = [[5, 17, 3, 9, 11], list(range(20, 31)), [7, 8, 9]]
    names = ["all", "base", "qv"]
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=3, ignore_eos=True, seed=3, logprobs=True)
    llm = LLM(m, num_kv_blocks=24, block_size=4, max_num_batched_tokens=8, enforce_eager=True, lora=ads)

    def gen(ps, ns):
        return [[(c.token_ids, c.logprobs) for c in o.outputs]
                for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False, lora=ns)]

    gens = gen(prompts, names)
    for p, name, outs in zip(prompts, names, gens):
        m.lora = ads.get(name)
        for toks, lps in outs:
            s = torch.tensor(p + toks, device=m.device)
            cu = torch.tensor([0, len(s)], device=m.device, dtype=torch.int32)
            lp = m.forward(s, cu, temperature=0.8, grad=False).cpu()
            assert torch.equal(torch.tensor(lps), lp[len(p):]), name
    m.lora = None
    assert gen(prompts[2:], names[2:]) == gens[2:]  # the last request alone
