"""The decode fast path (ModelRunner._decode, engine/decode_state.py): per-sequence block tables on the device kept in
sync incrementally (appends, copy-on-write, preemption, table reuse), one staging copy a step,
outputs independent of batch composition."""

import dataclasses

import pytest
from support.engine_util import GREEDY, PROMPTS
from support.hf_util import make_hf_model

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, folder = make_hf_model(tmp_path_factory.mktemp("decode"))
    return Qwen3.from_pretrained(folder)


def toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _checked(llm):
    """Wrap the runner's decode step: after each, every row's device table equals its block
    table, and its position, context length, KV slot, sample offset and known token are the
    host's (whether the step was staged from the host or continued on the device)."""
    r, calls = llm.runner, []
    orig = r._decode
    bs = r.block_size

    def decode(batch):
        out = orig(batch)
        d = r._dec
        v = {k: d.dev[k][:len(batch.seqs)].tolist() for k in ("pos", "lens", "kv_slots", "offsets", "ids")}
        for i, s in enumerate(batch.seqs):
            t = d.table_of[s.seq_id]
            assert d.tables[t, :len(s.block_table)].tolist() == s.block_table, s
            c = s.num_computed_tokens
            assert (v["pos"][i], v["lens"][i]) == (c, c + 1), s
            assert v["kv_slots"][i] == s.block_table[c // bs] * bs + c % bs, s
            assert v["offsets"][i] == len(s.token_ids) - s.num_prompt_tokens, s
            if s.token_ids[c] >= 0:
                assert v["ids"][i] == s.token_ids[c], s
        calls.extend(s.seq_id for s in batch.seqs)
        return out

    r._decode = decode
    return calls


@pytest.mark.parametrize("engine", [
    dict(num_kv_blocks=80, block_size=4, max_num_seqs=3),  # forks (copy-on-write), table reuse
    dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64),  # preemption
], ids=["reuse", "preempt"])
def test_device_tables_follow_block_tables(model, engine):
    ref = LLM(model, num_kv_blocks=256, block_size=4).generate(toks(PROMPTS), dataclasses.replace(GREEDY, n=2),
                                                                 use_tqdm=False)
    llm = LLM(model, **engine)
    calls = _checked(llm)
    got = llm.generate(toks(PROMPTS), dataclasses.replace(GREEDY, n=2), use_tqdm=False)
    assert calls and llm.runner._dec is not None
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    if engine["num_kv_blocks"] == 12:
        assert llm.stats["preemptions"] > 0
    else:  # 10 sequences through 2 * 3 tables: tables were reclaimed and reused
        assert len(set(calls)) > llm.runner._dec.num_tables >= len(llm.runner._dec.table_of)


def test_seeded_sampling_independent_of_batching(model):
    sp = SamplingParams(n=3, temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, max_tokens=12, seed=5,
                        ignore_eos=True, logprobs=True)
    a = LLM(model, num_kv_blocks=256, block_size=4).generate(toks(PROMPTS), sp, use_tqdm=False)
    llm = LLM(model, num_kv_blocks=256, block_size=4, max_num_seqs=2, async_scheduling=False)
    b = llm.generate(toks(PROMPTS), sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert llm.stats["decode_tokens"] > 0


def test_staging_overflow_falls_back(model):
    """Table updates larger than the pinned room travel in a second copy."""
    want = LLM(model, num_kv_blocks=64, block_size=4).generate(toks(PROMPTS), GREEDY, use_tqdm=False)
    llm = LLM(model, num_kv_blocks=64, block_size=4)
    d = llm.runner._dec_state()
    d.var_cap = 3
    _checked(llm)
    got = llm.generate(toks(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_release_drops_decode_state(model):
    llm = LLM(model, num_kv_blocks=64)
    a = llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert llm.runner._dec is not None
    llm.sleep()
    assert llm.runner._dec is None
    llm.wake()
    b = llm.generate(toks(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def _staged_only(llm):
    """Make every decode step stage its fields from the host (no continuation on the device)."""
    r = llm.runner
    orig = r._decode

    def decode(batch):
        if r._dec is not None:
            r._dec.invalidate()
        return orig(batch)

    r._decode = decode


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["lookahead", "sync"])
def test_continued_decode_steps_equal_staged_ones(model, async_scheduling):
    """Steps that run the previous step's batch again advance their fields on the device:
    seeded samples, logprobs and finish reasons are those of steps staged from the host,
    through block appends every 4 tokens, copy-on-write after forks, stop tokens and
    sequences finishing at different lengths."""
    sps = [SamplingParams(n=3, temperature=1.0, top_k=30, top_p=0.95, max_tokens=13 + 2 * i, seed=i,
                          logprobs=True, stop_token_ids=[7]) for i in range(len(PROMPTS))]
    kw = dict(num_kv_blocks=256, block_size=4, async_scheduling=async_scheduling)
    ref = LLM(model, **kw)
    _staged_only(ref)
    want = ref.generate(toks(PROMPTS), sps, use_tqdm=False)
    assert ref.runner.num_continued == 0
    llm = LLM(model, **kw)
    _checked(llm)
    got = llm.generate(toks(PROMPTS), sps, use_tqdm=False)
    assert llm.runner.num_continued > 0.5 * llm.stats["steps"]
    for a, b in zip(want, got):
        assert [(c.token_ids, c.logprobs, c.finish_reason) for c in a.outputs] == \
               [(c.token_ids, c.logprobs, c.finish_reason) for c in b.outputs]
    assert any(c.finish_reason == "stop" for o in got for c in o.outputs)


def test_decode_wider_than_max_num_seqs(model):
    """A request with n above max_num_seqs forks into more decode rows than the decode state
    holds: those steps go through `prepare` (its one packing of any step) and sample what a
    wider engine samples."""
    sp = SamplingParams(n=3, temperature=1.0, top_k=30, max_tokens=9, seed=3, ignore_eos=True, logprobs=True)
    want = LLM(model, num_kv_blocks=256, block_size=4).generate(toks(PROMPTS[:2]), sp, use_tqdm=False)
    llm = LLM(model, num_kv_blocks=256, block_size=4, max_num_seqs=2)
    r, wide = llm.runner, []
    orig = r.prepare

    def prepare(batch):
        wide.append(batch.is_decode)
        return orig(batch)

    r.prepare = prepare
    got = llm.generate(toks(PROMPTS[:2]), sp, use_tqdm=False)
    assert any(wide)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    for a, b in zip(got, want):  # (other batch shapes: the GEMMs may round the last bit differently)
        for x, y in zip(a.outputs, b.outputs):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
