"""`LLM.generate(yield_check=..., on_yield=...)`: the engine gives the device back between two
steps (every live sequence preempted for recompute, the KV pool released) and goes on after
on_yield returns. Yields in the middle of chunked prefill, during decode, after the n samples
of a request forked, and while blocks are shared by prefix caching must give the tokens and
logprobs of an uninterrupted call, leak no block, and call on_yield with the engine asleep."""

import pytest
import torch

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams
from rlcu.engine.sequence import Status
from rlcu.model.config import Qwen3Config

V = 333
SHARED = [(7 * i + 3) % V for i in range(13)]  # a prefix shared by the first three prompts
PROMPTS = [SHARED + [11, 12], SHARED + [20], SHARED + [30, 31, 32, 33, 34, 35], [5, 6, 7], [200 + i for i in range(17)]]
STOP = list(range(0, V, 9))  # ~11% of the vocabulary: some samples stop early


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, bos_token_id=None,
                      eos_token_id=V - 1)
    return Qwen3.from_config(cfg, device="cpu", dtype=torch.float32, seed=3, init_std=0.2)


def params():
    return [SamplingParams(n=n, temperature=1.0, max_tokens=9, seed=100 + i, logprobs=True,
                           stop_token_ids=STOP if i % 2 else [], ignore_eos=True)
            for i, n in enumerate([3, 2, 1, 2, 3])]


def toks(ps):
    return [{"prompt_token_ids": p} for p in ps]


# When to yield (asked between steps; each condition reads the engine's state at that moment)
def mid_prefill(llm):
    return any(0 < s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running)


def decoding(llm):
    return any(s.num_generated >= 2 for s in llm.scheduler.running)


def forked(llm):
    return any(s.sample_index > 0 for s in llm.scheduler.running)


def prefix_shared(llm):
    bm = llm.block_manager
    return any(s.num_cached_tokens > 0 for s in llm.scheduler.running) and any(b.ref > 1 for b in bm.blocks)


def always(llm):
    return True


def check_asleep(llm, tokens_left):
    """on_yield's view: the pool released, no sequence holding or awaiting anything."""
    sch, bm = llm.scheduler, llm.block_manager
    assert llm.asleep and llm.runner.kv is None
    assert bm.num_free == bm.num_blocks and all(b.ref == 0 for b in bm.blocks)
    assert not sch.running and not sch.unresolved and sch.waiting
    for s in sch.waiting:
        assert s.status is Status.WAITING and s.num_computed_tokens == 0 and not s.block_table
        assert s.num_pending == 0 and -1 not in s.token_ids
    want = sum(s.num_samples * (s.params.max_tokens - s.num_generated) for s in sch.waiting)
    assert tokens_left == want > 0


def run_yielding(llm, when, max_yields):
    pauses = []

    def yield_check():
        return len(pauses) < max_yields and when(llm)

    def on_yield(tokens_left):
        check_asleep(llm, tokens_left)
        pauses.append(tokens_left)

    outs = llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=yield_check, on_yield=on_yield)
    return outs, pauses


def assert_same(ref, got):
    for a, b in zip(ref, got):
        assert [c.index for c in a.outputs] == [c.index for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "sync"])
@pytest.mark.parametrize("when,max_yields", [(mid_prefill, 3), (decoding, 3), (forked, 2), (prefix_shared, 2),
                                             (always, 1000)], ids=["prefill", "decode", "forked", "prefix", "always"])
def test_yield_matches_uninterrupted(model, when, max_yields, lookahead):
    # 4-token blocks, 6-token steps: prompts of 14-19 tokens take 3-4 chunks; 4 sequences at a
    # time: later requests start from the cached blocks of SHARED
    llm = LLM(model, num_kv_blocks=48, block_size=4, max_num_batched_tokens=6, max_num_seqs=4,
              async_scheduling=lookahead)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    assert llm.stats["cached_tokens"] > 0 and llm.stats["yields"] == 0
    assert any(c.finish_reason == "stop" for o in ref for c in o.outputs)
    got, pauses = run_yielding(llm, when, max_yields)
    assert pauses and llm.stats["yields"] == len(pauses)
    if when is not always:
        assert len(pauses) == max_yields
        assert pauses == sorted(pauses, reverse=True)  # the work left only shrinks
    else:  # asked at once after a yield, the engine would recompute the same chunk forever
        assert len(pauses) > 10 and pauses == sorted(set(pauses), reverse=True)  # a new token between two yields
    assert_same(ref, got)
    bm = llm.block_manager
    assert not llm.asleep and llm.runner.kv is not None
    assert bm.num_free == bm.num_blocks and not llm.scheduler.live()  # nothing leaked
    bm.check([])


def test_yield_under_memory_pressure(model):
    """Yields mixed with the scheduler's own preemptions (a pool of 10 blocks)."""
    llm = LLM(model, num_kv_blocks=10, block_size=4, max_num_batched_tokens=8)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    assert llm.stats["preemptions"] > 0
    calls = [0]

    def every_third(_):
        calls[0] += 1
        return calls[0] % 3 == 0

    got, pauses = run_yielding(llm, every_third, 1000)
    assert len(pauses) >= 3
    assert_same(ref, got)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_no_yield_is_plain_generate(model):
    llm = LLM(model, num_kv_blocks=48, block_size=4, max_num_batched_tokens=6)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    calls = []
    got = llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: calls.append(1) or False,
                       on_yield=lambda n: pytest.fail("on_yield without a yield"))
    assert len(calls) >= llm.stats["steps"] - 1  # asked between steps (not once nothing is left to schedule)
    for a, b in zip(ref, got):  # the same schedule: bit-identical
        assert [(c.token_ids, c.logprobs) for c in a.outputs] == [(c.token_ids, c.logprobs) for c in b.outputs]


def test_yield_without_on_yield_resumes_at_once(model):
    llm = LLM(model, num_kv_blocks=48, block_size=4, max_num_batched_tokens=6)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    got = llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: True)
    assert llm.stats["yields"] > 0
    assert_same(ref, got)


def test_on_yield_raising_leaves_engine_asleep(model):
    llm = LLM(model, num_kv_blocks=48, block_size=4, max_num_batched_tokens=6)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)

    def give_up(_):
        raise KeyboardInterrupt  # e.g. the job was cancelled while waiting for its lease

    with pytest.raises(KeyboardInterrupt):
        llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: decoding(llm), on_yield=give_up)
    assert llm.asleep and not llm.scheduler.live()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    llm.wake()
    assert_same(ref, llm.generate(toks(PROMPTS), params(), use_tqdm=False))


def test_yield_arguments_validated(model):
    llm = LLM(model, num_kv_blocks=16, block_size=4)
    with pytest.raises(TypeError, match="yield_check"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False, yield_check=True)
    with pytest.raises(TypeError, match="on_yield"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False, yield_check=lambda: False, on_yield=3)


def test_on_done_is_called_once_after_the_steps(model):
    """generate(on_done=h): h() once every step is read back, the engine awake and idle, the
    yields of the call done; not when generate raises (a data-parallel job's ranks wait for each
    other there, rlcu.sched.dp)."""
    llm = LLM(model, num_kv_blocks=48, block_size=4, max_num_batched_tokens=6)
    seen, pauses = [], []

    def on_done():
        seen.append((llm.asleep, llm.scheduler.live(), llm.block_manager.num_free, len(pauses)))

    def give_up(_):
        raise KeyboardInterrupt

    llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: decoding(llm) and len(pauses) < 2,
                 on_yield=pauses.append, on_done=on_done)
    assert seen == [(False, [], llm.block_manager.num_blocks, 2)]
    llm.generate(toks(PROMPTS[:1]), params()[:1], use_tqdm=False, on_done=on_done)  # with no yield protocol too
    assert len(seen) == 2
    with pytest.raises(KeyboardInterrupt):
        llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: True, on_yield=give_up,
                     on_done=on_done)
    assert len(seen) == 2
    llm.wake()
    with pytest.raises(TypeError, match="on_done"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False, on_done=1)


def test_nothing_patches_generate():
    """Whoever must act after a generate passes on_done (the engine's hook); no code of rlcu
    replaces an engine's generate method (the data-parallel job once did, sched/dp.py)."""
    import re
    from pathlib import Path

    import rlcu

    root = Path(rlcu.__file__).parent
    pat = re.compile(r"\.generate\s*=[^=]|setattr\([^)]*[\"']generate[\"']")
    bad = [f"{f.relative_to(root)}:{i}" for f in sorted(root.rglob("*.py"))
           for i, line in enumerate(f.read_text().splitlines(), 1) if pat.search(line)]
    assert not bad, bad


@pytest.mark.gpu
def test_yield_on_gpu_releases_memory(model):
    """On CUDA (Triton kernels, CUDA graphs kept through the yield's sleep): the pool's memory
    goes back to the device during on_yield, and the tokens are those of an uninterrupted call."""
    m = Qwen3.from_config(model.cfg, device="cuda", dtype=torch.float32, seed=3, init_std=0.2)
    llm = LLM(m, num_kv_blocks=4096, block_size=16, max_num_batched_tokens=8)
    ref = llm.generate(toks(PROMPTS), params(), use_tqdm=False)
    pool = llm.runner.kv.numel() * llm.runner.kv.element_size()
    before = torch.cuda.memory_allocated()
    seen = []

    def on_yield(tokens_left):
        check_asleep(llm, tokens_left)
        seen.append(before - torch.cuda.memory_allocated())

    got = llm.generate(toks(PROMPTS), params(), use_tqdm=False, yield_check=lambda: decoding(llm) and len(seen) < 3,
                       on_yield=on_yield)
    # the pool goes back whole; a few small buffers of the step loop may be allocated meanwhile
    assert len(seen) == 3 and all(freed >= pool - (1 << 20) for freed in seen), (seen, pool)
    assert llm.stats["graph_steps"] > 0
    assert_same(ref, got)
