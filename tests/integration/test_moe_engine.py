"""Qwen3-MoE in the engine on the CPU (tiny, 5 experts top 2, a dense layer): greedy tokens against
transformers' `generate`, exact mode's engine logprobs equal to the trainer's forward bit for bit
with every routing the engine made the trainer's too, and the engine through the Triton kernels
(interpreted) equal to the twins."""


import pytest
import torch
from support.engine_util import GREEDY, PROMPTS, assert_kernels_equal_twins
from support.exact_util import assert_engine_is_trainer, sample
from support.hf_util import make_moe_model

import rlcu
from rlcu.engine import LLM, SamplingParams
from rlcu.engine.paged_forward import schedule
from rlcu.model import layer, moe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("moe"), seed=5)


def _toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("engine", [dict(num_kv_blocks=64), dict(num_kv_blocks=80, block_size=4,
                                                                   max_num_batched_tokens=7)],
                         ids=["plain", "chunked"])
def test_greedy_matches_hf_generate(pair, engine):
    hf, folder = pair
    m = rlcu.from_pretrained(folder)
    assert isinstance(schedule(m, 1), layer.Kernels)  # the plain schedule: no Fused for MoE
    llm = LLM(m, enforce_eager=True, **engine)
    outs = llm.generate(_toks(PROMPTS), GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref


def _recording(monkeypatch, seen: set):
    """route_fwd that adds each row's (experts, weights' bits) to `seen`."""
    route = moe.route_fwd

    def rec(logits, k, norm):
        ids, w, p = route(logits, k, norm)
        seen.update(zip(map(tuple, ids.tolist()), map(tuple, w.view(torch.int32).tolist())))
        return ids, w, p

    monkeypatch.setattr(moe, "route_fwd", rec)


def test_exact_engine_equals_trainer_bit_for_bit(pair, monkeypatch):
    _, folder = pair
    m = rlcu.from_pretrained(folder, exact=True)
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=6, ignore_eos=True, seed=11, logprobs=True)
    llm = LLM(m, enforce_eager=True, num_kv_blocks=80, block_size=4, max_num_batched_tokens=7)
    engine_routes, trainer_routes = set(), set()
    _recording(monkeypatch, engine_routes)
    gens = sample(llm, PROMPTS, sp)
    _recording(monkeypatch, trainer_routes)
    assert_engine_is_trainer(m, gens, sp.temperature)
    assert engine_routes and engine_routes <= trainer_routes  # every route the engine took, bit for bit


def test_exact_engine_with_expert_adapters_equals_trainer(pair, monkeypatch):
    """LoRA on the experts in the engine (one adapter, read in place, chunked prefill and decode):
    exact mode's logprobs are the trainer's forward with the adapter for its requests and without it
    for the base's, in one batch; the engine on the Triton kernels (interpreted) gives the twins';
    two adapters with expert targets are refused by name. 12-18 s on a loaded CPU, half of it the
    interpreted kernels: the one check of the expert adapters through the engine on Triton."""
    from rlcu.model.lora import LoraAdapters, LoraConfig

    _, folder = pair
    m = rlcu.from_pretrained(folder, exact=True)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]  # router too
    ad = LoraAdapters.create(m.cfg, LoraConfig(r=3, alpha=5, target_modules=names))
    ad.flat.copy_(torch.randn(ad.flat.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    ad.attach(m)
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=5, ignore_eos=True, seed=3, logprobs=True)
    llm = LLM(m, enforce_eager=True, num_kv_blocks=80, block_size=4, max_num_batched_tokens=7)
    names = [("model", "base")[j % 2] for j in range(len(PROMPTS))]
    outs = llm.generate(_toks(PROMPTS), sp, use_tqdm=False, lora=names)
    for p, name, o in zip(PROMPTS, names, outs):
        m.lora = ad if name == "model" else None
        assert_engine_is_trainer(m, [(p, c.token_ids, c.logprobs) for c in o.outputs], sp.temperature)
    m.lora = ad
    assert_kernels_equal_twins(m, monkeypatch)
    with pytest.raises(ValueError, match="one per engine"):
        LLM(m, enforce_eager=True, num_kv_blocks=80, lora={"other": LoraAdapters.create(m.cfg, ad.cfg)})


@pytest.mark.parametrize("exact", [True, False])
def test_completions_carry_the_engine_routes(pair, exact):
    """Each completion's routes (engine/routes.py: the experts by kv slot, copied out as it
    retires) are its prompt's and completion's rows but the last, the trainer's own choices on
    the same packed rows; chunked prefill, prefix sharing of the n samples and stop tokens
    included. In exact mode equal by construction; the CPU twins are batch invariant in both."""
    from rlcu.engine.routes import bytes_per_token
    from rlcu.model.routes import Routes

    _, folder = pair
    m = rlcu.from_pretrained(folder, exact=exact)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=7, seed=5, logprobs=True)
    llm = LLM(m, enforce_eager=True, num_kv_blocks=80, block_size=4, max_num_batched_tokens=7)
    outs = llm.generate(_toks(PROMPTS), sp, use_tqdm=False)
    Ls, k = len(m.cfg.sparse_layers), m.cfg.num_experts_per_tok
    assert bytes_per_token(m.cfg) == Ls * k
    for p, o in zip(PROMPTS, outs):
        for c in o.outputs:
            seq = p + c.token_ids
            r = Routes(m.cfg, len(seq), m.device)
            m.forward(torch.tensor(seq), torch.tensor([0, len(seq)], dtype=torch.int32), grad=False, routes=r)
            assert c.routes.shape == (len(seq) - 1, Ls, k) and c.routes.dtype == torch.uint8
            assert torch.equal(c.routes.to(torch.int16), r.taken[:-1])


def test_engine_on_kernels_equals_twins(pair, monkeypatch):
    _, folder = pair
    m = rlcu.from_pretrained(folder, device="cuda" if torch.cuda.is_available() else "cpu")
    assert_kernels_equal_twins(m, monkeypatch)


def _moe_folder(tmp_path):
    """A tiny Qwen3-MoE of the sort task's tokenizer (5 experts top 2, layer 1 dense, its load-balancing
    loss on: output_router_logits) saved under tmp_path/moe."""
    from support.trainers import TINY

    from rlcu.data import synthetic as syn

    tok = syn.make_tokenizer()
    shape = dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id, num_hidden_layers=2)
    cfg = rlcu.CausalLMConfig(**shape, family="qwen3_moe", num_experts=5, num_experts_per_tok=2,
                              moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=(1,),
                              output_router_logits=True)
    folder = tmp_path / "moe"
    rlcu.CausalLM.from_config(cfg, seed=3).save_pretrained(folder)
    return folder


def test_grpo_learns_from_a_moe_folder(tmp_path):
    """A short GRPO run from a Qwen3-MoE folder with its load-balancing loss on: it learns the
    first-is-seven task, the routers and experts among what it updates."""
    from support.trainers import first_is_seven, grpo_trainer

    tr = grpo_trainer(tmp_path, rewards=[first_is_seven], steps=16, prompts_per_step=8, group_size=8,
                      max_new_tokens=2, optim=dict(lr=2e-2), loss_agg="seq_mean", clip_high=0.28,
                      model=dict(tiny=None, path=str(_moe_folder(tmp_path))))
    before = {k: tr.model.w[k].clone() for k in ("layers.0.router", "layers.0.experts_gate_up")}
    hist = tr.train()
    assert tr.model.cfg.family == "qwen3_moe" and tr.model.aux_loss is not None
    assert all(h["moe/aux_loss"] > 0 for h in hist)  # train/moe_aux.py's, logged every step
    assert all(not torch.equal(tr.model.w[k], v) for k, v in before.items())
    r = [round(h["reward"], 3) for h in hist]
    assert r[0] < 0.3 and sum(r[-3:]) / 3 > 0.7, r


def test_the_scheduler_sizes_a_moe_job_from_its_folder(tmp_path):
    from support.trainers import grpo_config

    from rlcu.memory.parts import params
    from rlcu.sched.job import estimate_memory
    from rlcu.train.sizing import config_shape

    folder = _moe_folder(tmp_path)
    cfg, _ = grpo_config(tmp_path, model=dict(tiny=None, path=str(folder)))
    shape = config_shape(cfg)
    assert shape.cfg.num_experts == 5 and params(shape.cfg) == rlcu.from_pretrained(folder).flat.numel()
    assert estimate_memory(cfg)["resident"] > 0
