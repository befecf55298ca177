"""LoRA in the engine on the GPU, exact mode, bf16, through the CUDA graphs (decode graphs replayed
with each step's adapter slots among their static fields; exact mode's prefill runs eagerly): a
batch of 24 requests (n = 4) spread over three adapters of two ranks and target sets and the base
gives sampled-token logprobs equal to the trainer's forward with each sequence's adapter attached,
bit for bit (100% of tokens), and a few requests generated alone give the same tokens and bits."""

import pytest
import torch
from support.exact_util import tiny_model

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams
from rlcu.model.lora import LoraAdapters, LoraConfig

pytestmark = pytest.mark.gpu

SHAPE = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def _adapter(m, cfg, seed):
    ad = LoraAdapters.create(m.cfg, cfg, m.device, m.dtype)
    g = torch.Generator().manual_seed(seed)
    ad.flat.copy_(torch.randn(ad.flat.shape, generator=g) * 0.05)
    return ad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_exact_mode_with_adapters_through_the_graphs():
    cpu = tiny_model(**SHAPE)
    m = Qwen3(cpu.cfg, cpu.flat.to("cuda", torch.bfloat16))
    m.exact = True
    ads = {"a": _adapter(m, LoraConfig(r=8, alpha=16, target_modules="all-linear"), 1),
           "b": _adapter(m, LoraConfig(r=16, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), 2),
           "c": _adapter(m, LoraConfig(r=8, alpha=8, target_modules="all-linear"), 3)}
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(5, 90, (24,), generator=g).tolist()
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in lens]
    names = [("a", "b", "c", "base")[k % 4] for k in range(24)]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=48, ignore_eos=True, seed=5, logprobs=True)
    llm = LLM(m, lora=ads, max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=1024)

    def gen(ps, ns):
        return [[(c.token_ids, c.logprobs) for c in o.outputs]
                for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False, lora=ns)]

    gens = gen(prompts, names)
    assert llm.stats["graph_steps"] > 0
    equal = total = 0
    for name in ("a", "b", "c", "base"):
        m.lora = ads.get(name)
        rows = [(p, t, lp) for p, n, outs in zip(prompts, names, gens) if n == name for t, lp in outs]
        seqs = [p + t for p, t, _ in rows]
        tokens = torch.tensor([x for s in seqs for x in s], device="cuda")
        cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), device="cuda",
                          dtype=torch.int32)
        lp = m.forward(tokens, cu, temperature=1.0, grad=False).float().cpu()
        for (p, t, lps), s in zip(rows, cu[:-1].tolist()):
            want = lp[s + len(p):s + len(p) + len(t)]
            equal += int((torch.tensor(lps) == want).sum())
            total += len(t)
    m.lora = None
    assert equal == total, f"{equal} of {total} tokens bit-equal"
    assert gen(prompts[:3], names[:3]) == gens[:3]
