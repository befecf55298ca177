"""The engine with LoRA adapters (engine/lora.py), fp32 on the CPU twins: greedy generation with a
PEFT folder equals transformers + PEFT's generate; a batch mixing adapters (and none) equals each
request alone (exact mode: tokens and logprobs bit for bit; default mode: greedy tokens); exact
mode's sampled-token logprobs equal the trainer's forward with the same adapter attached, bit for
bit; the model's attached adapter is read in place (an update in place is seen without a sync);
the prefix cache never shares blocks across adapters; an adapter that does not fit is refused by
name, and so is a request naming one the engine does not serve."""

import pytest
import torch
from support.exact_util import tiny_model
from support.lora_util import base_pair, peft_twin, random_adapter

import rlcu
from rlcu.engine import LLM, SamplingParams
from rlcu.engine.params import InvalidRequestError
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.model.lora_peft import save_adapter

SHAPE = {"vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}
QV = LoraConfig(r=3, alpha=5, target_modules=["q_proj", "v_proj"])
ALL = LoraConfig(r=4, alpha=7, target_modules="all-linear")
PROMPTS = [[5, 17, 3, 9, 11, 2, 40, 41, 42], list(range(20, 33)), [7, 7, 8]]


def _adapter(m, cfg, seed):
    """A random adapter for m (A and B N(0, 0.3): it changes the tokens), not attached."""
    ad = LoraAdapters.create(m.cfg, cfg, m.device, m.dtype)
    g = torch.Generator().manual_seed(seed)
    ad.flat.copy_(torch.randn(ad.flat.shape, generator=g) * 0.3)
    return ad


def _engine(m, **kw):
    return LLM(m, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, enforce_eager=True, **kw)


def _gen(llm, prompts, sp, lora=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora=lora)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_greedy_with_a_peft_folder_equals_hf_peft_generate(tmp_path):
    pytest.importorskip("peft")
    hf, folder = base_pair(tmp_path, "qwen3")
    m = rlcu.from_pretrained(folder)
    ad = random_adapter(m, ALL)
    pm = peft_twin(hf, ad, tmp_path / "adapter")  # saves the adapter folder PEFT then loads
    m.lora = None
    llm = LLM(folder, device="cpu", num_kv_blocks=32, block_size=4, lora=tmp_path / "adapter")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], sp,
                                                          use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], sp,
                                                           use_tqdm=False, lora="base")]
    for p, toks in zip(PROMPTS[:2], got):
        with torch.no_grad():
            ref = pm.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref
    assert got != base  # the adapter matters


@pytest.mark.parametrize("exact", [True, False])
def test_mixed_adapters_in_one_batch_equal_each_alone(exact):
    """Three adapters of two ranks and target sets (padded into one slab) and the base, one batch."""
    m = tiny_model(exact=exact, **SHAPE)
    ads = {"qv": _adapter(m, QV, 1), "all": _adapter(m, ALL, 2), "all2": _adapter(m, ALL, 3)}
    llm = _engine(m, lora=ads)
    names = ["qv", "all", "base", "all2", "all", "qv"]
    prompts = [PROMPTS[k % 3] for k in range(len(names))]
    if exact:
        sp = SamplingParams(n=2, temperature=0.8, max_tokens=5, ignore_eos=True, seed=3, logprobs=True)
    else:
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    mixed = _gen(llm, prompts, sp, names)
    for k, name in enumerate(names):
        alone = _gen(llm, [prompts[k]], sp, name)[0]
        if exact:
            assert alone == mixed[k], name
        else:
            assert [t for t, _ in alone] == [t for t, _ in mixed[k]], name
    outs = {name: mixed[k] for k, name in enumerate(names)}
    assert len({str([t for t, _ in outs[n]]) for n in ("qv", "all", "base", "all2")}) == 4  # each adapter matters


@pytest.mark.parametrize("cfg", [ALL, QV], ids=["all", "qv"])
def test_exact_mode_logprobs_equal_the_trainers_forward_with_the_adapter(cfg):
    """The model's attached adapter (the trainer's, read in place) and a named one beside it:
    each sequence's sampled-token logprobs are the forward's with its adapter attached."""
    m = tiny_model(exact=True, **SHAPE)
    mine, other = _adapter(m, cfg, 4), _adapter(m, ALL, 5)
    mine.attach(m)
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=4, ignore_eos=True, seed=1, logprobs=True)
    for served in ({}, {"other": other}):
        llm = _engine(m, lora=served or None)
        names = ["model", "other", None] if served else [None, "base", "model"]
        gens = _gen(llm, PROMPTS, sp, names)
        for p, name, outs in zip(PROMPTS, names, gens):
            m.lora = {"model": mine, None: mine, "other": other, "base": None}[name]
            for toks, lps in outs:
                s = p + toks
                lp = m.forward(torch.tensor(s), torch.tensor([0, len(s)], dtype=torch.int32), temperature=0.8,
                               grad=False)
                assert torch.equal(torch.tensor(lps), lp[len(p):]), (served, name)
            m.lora = mine


def test_the_attached_adapter_is_read_in_place():
    """An update of the trainer's adapter in place is what the next generate samples from (no
    sync), in place when it is the only adapter and through the slab's refresh beside others."""
    m = tiny_model(**SHAPE)
    ad = _adapter(m, ALL, 6).attach(m)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for served in (None, {"x": _adapter(m, QV, 7)}):
        llm = _engine(m, lora=served)
        before = _gen(llm, PROMPTS, sp)
        assert llm.runner.lora.in_place == (served is None)
        ad.flat.mul_(-1.5)
        after = _gen(llm, PROMPTS, sp)
        m.lora = None
        base = _gen(_engine(m), PROMPTS, sp)
        ad.attach(m)
        assert after != before and after != base
        fresh = _gen(_engine(m), PROMPTS, sp)  # a new engine over the updated adapter
        assert after == fresh
        ad.flat.div_(-1.5)


def test_prefix_cache_is_not_shared_across_adapters():
    """The same prompt under two adapters: no block of one serves the other (their K/V differ);
    under the same adapter it does."""
    m = tiny_model(**SHAPE)
    llm = _engine(m, lora={"a": _adapter(m, ALL, 8), "b": _adapter(m, ALL, 9)})
    p = list(range(30, 47))  # four full blocks of 4 and one token
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = {n: _gen(llm, [p], sp, n)[0] for n in ("a", "b", "base")}
    bm = llm.block_manager
    hits = bm.hit_tokens
    got = _gen(llm, [p, p, p], sp, ["a", "b", "base"])
    assert got == [want["a"], want["b"], want["base"]]
    assert bm.hit_tokens == hits  # three adapters, three prefills
    seqs = [rlcu.engine.sequence.Sequence(0, p, sp, 0) for _ in range(3)]
    for s, lora in zip(seqs, (0, 1, 0)):
        s.lora = lora
    keys = [bm._block_hash(s, 0) for s in seqs]
    assert keys[0] == keys[2] != keys[1]
    got = _gen(llm, [p, p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), ["a", "a"])
    assert got == [want["a"]] * 2


def test_bad_adapters_and_names_are_refused(tmp_path):
    m = tiny_model(**SHAPE)
    wide = tiny_model(**{**SHAPE, "hidden_size": 64})
    with pytest.raises(ValueError, match=r"LLM.lora\['w'\].*hidden_size 64"):
        _engine(m, lora={"w": _adapter(wide, QV, 1)})
    save_adapter(_adapter(wide, QV, 1), tmp_path / "wide")
    with pytest.raises(ValueError, match=r"LLM.lora\['default'\].*does not fit the base.*shape"):
        _engine(m, lora=tmp_path / "wide")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        _engine(m, lora={"x": tmp_path / "nowhere"})
    with pytest.raises(ValueError, match="reserved|other than"):
        _engine(m, lora={"base": _adapter(m, QV, 1)})
    llm = _engine(m, lora={"a": _adapter(m, QV, 1)})
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'zz'.*base, a"):
        _gen(llm, PROMPTS[:2], sp, ["a", "zz"])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], sp, use_tqdm=False, on_error="return",
                        lora=["zz", "a"])
    assert "unknown LoRA adapter" in outs[0].error and outs[1].outputs


def test_rlcu_generate_lora(tmp_path, capsys):
    """`rlcu generate --lora PATH` on the tiny model equals LLM(model, lora=PATH); a folder of
    another shape is refused naming --lora, before anything runs."""
    import json

    from rlcu.engine.cli import main, tiny_model_and_tokenizer

    m, tok = tiny_model_and_tokenizer("cpu")
    save_adapter(_adapter(m, ALL, 11), tmp_path / "ad")
    args = ["generate", "--device", "cpu", "--temperature", "0", "--max-tokens", "4", "--ignore-eos",
            "--no-progress", "--num-kv-blocks", "64"]

    def run(*extra):
        out = tmp_path / "o.jsonl"
        assert main([*args, "--output", str(out), *extra]) == 0
        return [r["outputs"][0]["token_ids"] for r in map(json.loads, out.read_text().splitlines())]

    with_ad, without = run("--lora", str(tmp_path / "ad")), run()
    assert with_ad != without
    llm = LLM(m, tokenizer=tok, num_kv_blocks=64, lora=tmp_path / "ad")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    from rlcu.engine.cli import _TINY_PROMPTS

    assert [o.outputs[0].token_ids for o in llm.generate(_TINY_PROMPTS, sp, use_tqdm=False)] == with_ad
    save_adapter(_adapter(tiny_model(**SHAPE), QV, 1), tmp_path / "other")
    capsys.readouterr()
    assert main([*args, "--lora", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "--lora" in err and "does not fit the base" in err


def test_given_adapters_are_live_and_the_attached_one_is_served_once():
    """A LoraAdapters given to LLM is read again every generate call (a job's adapter being
    trained beside others); given as the model's attached one (the RL trainer's call), it is the
    model's slot, read in place, under both names."""
    m = tiny_model(**SHAPE)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    job = _adapter(m, ALL, 12)
    llm = _engine(m, lora={"job": job, "other": _adapter(m, QV, 13)})
    before = _gen(llm, PROMPTS, sp, "job")
    job.flat.mul_(-2.0)
    after = _gen(llm, PROMPTS, sp, "job")
    assert after != before and after == _gen(_engine(m, lora=job), PROMPTS, sp)
    job.attach(m)
    llm = _engine(m, lora=job)
    assert llm.runner.lora.names == ["model"] and llm.runner.lora.in_place
    assert _gen(llm, PROMPTS, sp, "default") == _gen(llm, PROMPTS, sp) == after
