"""The decode fast path (ModelRunner._decode): per-slot block tables on the device kept in
sync incrementally (appends, copy-on-write, preemption, slot reuse), one staging copy a step,
outputs independent of batch composition."""

import dataclasses

import pytest
from hf_util import make_hf_model

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)
PROMPTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 200 for i in range(30)], [1]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, folder = make_hf_model(tmp_path_factory.mktemp("decode"))
    return Qwen3.from_pretrained(folder)


def toks(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _checked(llm):
    """Wrap the runner's decode step: after each, every row's device table equals its block table."""
    r, calls = llm.runner, []
    orig = r._decode

    def decode(batch):
        out = orig(batch)
        d = r._dec
        for s in batch.seqs:
            sl = d.slot_of[s.seq_id]
            assert d.slot_tables[sl, :len(s.block_table)].tolist() == s.block_table, s
        calls.extend(s.seq_id for s in batch.seqs)
        return out

    r._decode = decode
    return calls


@pytest.mark.parametrize("engine", [
    dict(num_kv_blocks=80, block_size=4, max_num_seqs=3),  # forks (copy-on-write), slot reuse
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
    else:  # 10 sequences through 2 * 3 slots: slots were reclaimed and reused
        assert len(set(calls)) > llm.runner._dec.num_slots >= len(llm.runner._dec.slot_of)


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
