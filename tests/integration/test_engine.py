"""The engine end to end on the CPU twins against HF transformers' greedy `generate` and the
model's own `forward` logprobs, on tiny random checkpoints."""

import dataclasses

import numpy as np
import pytest
import torch
from support.engine_util import GREEDY, PROMPTS
from support.hf_util import make_hf_model, rel_err

from rlcu import Qwen3
from rlcu.engine import LLM, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    hf, folder = make_hf_model(tmp_path_factory.mktemp("engine"))
    return hf, folder


@pytest.fixture
def model(hf_pair):
    return Qwen3.from_pretrained(hf_pair[1])


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("engine", [
    dict(num_kv_blocks=64),  # default block size
    dict(num_kv_blocks=80, block_size=4, max_num_batched_tokens=7),  # chunked prefill mixed with decode
    dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64),  # preemption: 48 token slots for 5 requests
    dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=7, async_scheduling=False),  # both, no lookahead
], ids=["plain", "chunked", "preempt", "sync"])
def test_greedy_matches_hf(hf_pair, model, engine):
    hf, _ = hf_pair
    llm = LLM(model, **engine)
    sp = dataclasses.replace(GREEDY, n=2)
    outs = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ref = hf_greedy(hf, p, sp.max_tokens)
        assert o.prompt_token_ids == p
        assert [c.index for c in o.outputs] == [0, 1]
        for c in o.outputs:  # both samples of a greedy request equal HF (fork + copy-on-write)
            assert c.token_ids == ref and c.finish_reason == "length"
    if engine["num_kv_blocks"] == 12:
        assert llm.stats["preemptions"] > 0
    if engine.get("max_num_batched_tokens") == 7:
        assert max(n for n, *_ in llm.stats["step_log"]) <= 7
    assert llm.block_manager.num_free == llm.block_manager.num_blocks  # nothing leaked


def test_logprobs_match_forward(model):
    llm = LLM(model, num_kv_blocks=64, block_size=8)
    for sp in (SamplingParams(n=3, temperature=0.7, top_k=50, top_p=0.9, max_tokens=9, seed=3, ignore_eos=True,
                              logprobs=True), GREEDY):
        outs = llm.generate(toks(PROMPTS[:3]), sp, use_tqdm=False)
        seqs = [p + c.token_ids for p, o in zip(PROMPTS, outs) for c in o.outputs]
        tokens = torch.tensor([t for s in seqs for t in s])
        cu = torch.tensor([0] + [sum(len(s) for s in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
        lp = model.forward(tokens, cu, temperature=sp.temperature or 1.0, grad=False)
        got, want = [], []
        for k, (p, c) in enumerate((p, c) for p, o in zip(PROMPTS, outs) for c in o.outputs):
            got += c.logprobs
            want += lp[int(cu[k]) + len(p): int(cu[k + 1])].tolist()
        assert rel_err(torch.tensor(got), torch.tensor(want)) < 1e-5


def test_seeded_sampling_reproducible(model):
    sp = SamplingParams(n=4, temperature=1.5, max_tokens=8, seed=11, ignore_eos=True)
    a = LLM(model, num_kv_blocks=64).generate(toks(PROMPTS[:2]), sp, use_tqdm=False)
    b = LLM(model, num_kv_blocks=40, block_size=4, max_num_batched_tokens=5).generate(
        toks(PROMPTS[1:2] + PROMPTS[:1]), sp, use_tqdm=False)  # other order, chunking, batching
    ta = [[c.token_ids for c in o.outputs] for o in a]
    tb = [[c.token_ids for c in o.outputs] for o in b][::-1]
    assert ta == tb
    assert len({tuple(t) for t in ta[0]}) > 1  # the n samples differ
    c = LLM(model, num_kv_blocks=64).generate(toks(PROMPTS[:2]), dataclasses.replace(sp, seed=12), use_tqdm=False)
    assert [[x.token_ids for x in o.outputs] for o in c] != ta


def test_weights_shared_in_place(hf_pair, model):
    hf, _ = hf_pair
    llm = LLM(model, num_kv_blocks=64)
    before = [o.outputs[0].token_ids for o in llm.generate(toks(PROMPTS[:3]), GREEDY, use_tqdm=False)]
    g = torch.Generator().manual_seed(5)
    model.flat.add_(0.05 * torch.randn(model.flat.shape, generator=g))  # an "optimizer step", in place
    after = [o.outputs[0].token_ids for o in llm.generate(toks(PROMPTS[:3]), GREEDY, use_tqdm=False)]
    assert after != before
    import copy

    hf2 = copy.deepcopy(hf)
    hf2.load_state_dict({k: v.clone() for k, v in model.params.items()}, strict=False)
    for p, a in zip(PROMPTS, after):
        assert a == hf_greedy(hf2, p, GREEDY.max_tokens)


def test_prefix_cache_across_requests(model):
    # max_num_seqs=1: the second request starts after the first finished, from its cached blocks
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_num_seqs=1)
    shared = list(range(50, 70))
    ps = [shared + [1, 2], shared + [3]]
    out = llm.generate(toks(ps), GREEDY, use_tqdm=False)
    assert llm.stats["cached_tokens"] == 20
    fresh = LLM(model, num_kv_blocks=64, enable_prefix_caching=False).generate(toks(ps), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fresh] == [o.outputs[0].token_ids for o in out]
    llm.generate(toks(ps), GREEDY, use_tqdm=False)
    assert llm.stats["cached_tokens"] == 20  # not 60: the cache does not outlive a call


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "sync"])
def test_stop_tokens_eos_and_context_limit(model, lookahead):
    llm = LLM(model, num_kv_blocks=64, async_scheduling=lookahead)
    ref = llm.generate(toks(PROMPTS[:1]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = ref[3]
    k = ref.index(stop)
    o = llm.generate(toks(PROMPTS[:1]), dataclasses.replace(GREEDY, stop_token_ids=[stop]),
                     use_tqdm=False)[0].outputs[0]
    assert o.token_ids == ref[:k + 1] and o.finish_reason == "stop" and len(o.logprobs) == k + 1
    # n samples, stop and length limits in the same step, other requests around
    sp = dataclasses.replace(GREEDY, stop_token_ids=[stop], n=3, max_tokens=k + 1)
    outs = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [ref[:k + 1]] * 3
    assert {c.finish_reason for c in outs[0].outputs} == {"stop"}
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    model.cfg.eos_token_id = stop
    try:
        o = llm.generate(toks(PROMPTS[:1]), dataclasses.replace(GREEDY, ignore_eos=False), use_tqdm=False)[0].outputs[0]
        assert o.token_ids == ref[:k + 1] and o.finish_reason == "stop"
        o = llm.generate(toks(PROMPTS[:1]), GREEDY, use_tqdm=False)[0].outputs[0]
        assert o.token_ids == ref
    finally:
        model.cfg.eos_token_id = None
    short = LLM(model, num_kv_blocks=64, max_model_len=8)
    o = short.generate(toks(PROMPTS[:1]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert o.token_ids == ref[:5] and o.finish_reason == "length"


def test_bad_inputs(model):
    llm = LLM(model, num_kv_blocks=64, max_model_len=32)
    good = llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    bad_prompts = [
        ([], "empty prompt"),
        (list(range(32)), "context holds 32"),
        ([3, 333, 4], "token id 333 is outside the vocabulary"),
        ([3, -1], "token id -1"),
        ([3, True, 4], "must be a list of integers"),  # a bool is no token id
        ([3, 4.0], "must be a list of integers"),
        ([np.int64(3), 999], "token id 999"),
    ]
    for bad, msg in bad_prompts:
        with pytest.raises(InvalidRequestError, match=f"request 1: .*{msg}") as ei:
            llm.generate(toks([PROMPTS[0], bad, PROMPTS[1]]), GREEDY, use_tqdm=False)
        assert list(ei.value.errors) == [1] and isinstance(ei.value, ValueError)
        outs = llm.generate(toks([PROMPTS[0], bad, PROMPTS[1]]), GREEDY, use_tqdm=False, on_error="return")
        assert outs[1].error is not None and msg.split()[0] in outs[1].error and outs[1].outputs == []
        assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in good]
    # sampling parameters: refused at construction, and again at submission if changed afterwards
    for field, value in (("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("max_tokens", 0)):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})
        sp = dataclasses.replace(GREEDY)
        setattr(sp, field, value)
        with pytest.raises(InvalidRequestError, match=f"request 0: SamplingParams.{field}"):
            llm.generate(toks(PROMPTS[:2]), [sp, GREEDY], use_tqdm=False)
        outs = llm.generate(toks(PROMPTS[:2]), [sp, GREEDY], use_tqdm=False, on_error="return")
        assert outs[0].error and outs[1].outputs[0].token_ids == good[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate(toks(PROMPTS[:2]), [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="needs a tokenizer|need a tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_engine_args_validated(model):
    for kw, field in ((dict(max_num_seqs=0), "max_num_seqs"), (dict(block_size=6), "block_size"),
                      (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(dtype="int8"), "dtype"),
                      (dict(device="meta"), "device"), (dict(num_kv_blocks=0), "num_kv_blocks")):
        with pytest.raises(ValueError, match=f"LLM.{field}"):
            LLM(model, **kw)


class WordTok:
    """A stand-in tokenizer: words are ids."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [int(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = [m for msg in messages for m in [1] + self.encode(msg["content"]) + [2]]
        return ids + ([3] if add_generation_prompt else [])


def test_text_and_chat_prompts(model):
    llm = LLM(model, num_kv_blocks=64, tokenizer=WordTok())
    outs = llm.generate(["5 17 3", {"prompt": "7 7 7"}, [5, 17, 3]], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == [5, 17, 3] and outs[0].prompt == "5 17 3"
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].text == " ".join(map(str, outs[0].outputs[0].token_ids))
    chat = [{"role": "user", "content": "9 8"}]
    o = llm.chat(chat, GREEDY, use_tqdm=False)
    assert len(o) == 1 and o[0].prompt_token_ids == [1, 9, 8, 2, 3] and o[0].prompt == chat
    assert len(llm.chat([chat, chat], GREEDY, use_tqdm=False)) == 2


def test_sleep_wake(model):
    llm = LLM(model, num_kv_blocks=64)
    a = llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    llm.sleep()
    assert llm.runner.kv is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    llm.wake()
    b = llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_progress_bar_runs(model, capsys):
    LLM(model, num_kv_blocks=64).generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=True)
    assert "tok/s" in capsys.readouterr().err


def test_graph_replay_logic_emulated(model):
    """The decode- and prefill-graph paths (static buffers, batch and token padding, buckets,
    the tile list, placeholders, the LM head and the sampler inside the graph) on the CPU: a
    'graph' that re-runs the captured step on the static buffers at replay stands in for a
    CUDA graph. Greedy and seeded sampling (padding rows must not change the real rows' draws),
    with a small token budget so that prompts are chunked and mixed with decodes."""
    sampled = SamplingParams(n=2, temperature=0.8, top_k=5, max_tokens=6, seed=3, logprobs=True)
    ref = LLM(model, num_kv_blocks=64, block_size=4, max_num_seqs=6)
    want = [ref.generate(toks(PROMPTS), sp, use_tqdm=False) for sp in (dataclasses.replace(GREEDY, n=2), sampled)]
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    r = llm.runner
    r.use_graphs = True

    def record(fn):
        out = fn()
        return (lambda: [o.copy_(n) for o, n in zip(out, fn())]), out

    r.decode_graphs._record = r.prefill_graphs._record = record
    staged, load = [], r.prefill_graphs.load

    def spy(a, last):
        staged.append((len(a["ids"]), len(a["ph"])))
        return load(a, last)

    r.prefill_graphs.load = spy
    got = [llm.generate(toks(PROMPTS), sp, use_tqdm=False) for sp in (dataclasses.replace(GREEDY, n=2), sampled)]
    assert llm.stats["graph_steps"] > 0 and {b for b, _ in r.graphs} >= {4, 6}
    assert set(r.prefill_graphs.graphs) == {24}
    # full and padded steps, and steps whose decode tokens are the last step's samples
    assert {n == 24 for n, _ in staged} == {True, False} and any(p for _, p in staged)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                assert rel_err(torch.tensor(y.logprobs), torch.tensor(x.logprobs)) < 1e-5
    model.flat.mul_(1.0)  # in place: the same graphs stay valid
    llm.generate(toks(PROMPTS[:1]), GREEDY, use_tqdm=False)
    assert r.graphs


def test_sleep_keeping_graphs_emulated(model):
    """sleep(keep_graphs=True): the graphs survive a wake whose pool lands at the same address
    and are captured again when it does not; outputs equal a fresh engine's either way."""
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=5, logprobs=True)
    want = LLM(model, num_kv_blocks=64, block_size=4, max_num_seqs=6).generate(toks(PROMPTS), sp, use_tqdm=False)
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_num_seqs=6)
    r = llm.runner
    r.use_graphs = True
    captures = []

    def record(fn):
        captures.append(1)
        out = fn()
        return (lambda: [o.copy_(n) for o, n in zip(out, fn())]), out

    def record_prefill(fn):
        out = fn()
        return (lambda: [o.copy_(n) for o, n in zip(out, fn())]), out

    r.decode_graphs._record, r.prefill_graphs._record = record, record_prefill
    for moved in (False, True, False):
        llm.generate(toks(PROMPTS), sp, use_tqdm=False)
        n = len(captures)
        llm.sleep(keep_graphs=True)
        assert llm.runner.kv is None and r.graphs and not r.prefill_graphs.graphs  # those go (their pool is big)
        # the CPU allocator promises no address: say where the pool "was" to steer the test
        zeros = torch.zeros

        def pool_at(*a, **k):
            t = zeros(*a, **k)
            r.decode_graphs.kv_ptr = -1 if moved else (t.data_ptr(), 0)  # ModelRunner._pool_key: (KV, no route log)
            return t

        torch.zeros = pool_at
        try:
            llm.wake()
        finally:
            torch.zeros = zeros
        got = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
        assert r.prefill_graphs.graphs  # captured again on first use
        assert (len(captures) > n) == moved, (moved, n, len(captures))
        for a, b in zip(want, got):
            assert [x.token_ids for x in a.outputs] == [y.token_ids for y in b.outputs]
    assert r.graph_wakes["kept"] >= 2 and r.graph_wakes["recaptured"] >= 1
    llm.sleep()  # the default frees the graphs too
    assert not r.graphs and not r.prefill_graphs.graphs


def test_numpy_and_tuple_prompts_equal_lists(model):
    """Prompt ids given as numpy ints or a tuple are the same request as a list of ints."""
    llm = LLM(model, num_kv_blocks=64, max_model_len=32)
    ids = toks(PROMPTS[:1])[0]["prompt_token_ids"]
    ref = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for alt in ([np.int32(t) for t in ids], tuple(ids), np.array(ids).tolist()):
        got = llm.generate([{"prompt_token_ids": alt}], GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == ref and got.prompt_token_ids == list(ids)
