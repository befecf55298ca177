"""LLM.run_episodes (engine/episodes.py) on the CPU twins with a tiny random model: turns end and
resume with the environment's tokens (mask 0, logprob 0.0), a resumed sequence computes only its
new tokens (every position of an episode is computed once), a slow callback does not hold the
others back, exceptions and bad answers end one episode, the limits, groups of n, preemption of
parked sequences, and exact mode: the model tokens' logprobs are the trainer's forward over the
whole trajectory bit for bit, and each turn is what a from-scratch generate of its prefix gives."""

import threading
import time

import pytest
import torch
from support.exact_util import tiny_model

from rlcu.engine import LLM, Episode, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SHAPE = {"vocab_size": 257, "hidden_size": 56, "intermediate_size": 90, "num_attention_heads": 7,
         "num_key_value_heads": 1, "head_dim": 20}
STARTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 150 for i in range(30)]]
SP = SamplingParams(temperature=1.0, max_tokens=6, seed=3, logprobs=True)


@pytest.fixture(scope="module")
def exact():
    return tiny_model(exact=True, **SHAPE)


def env(turns=2, n_tokens=3, sleep=None):
    """An environment that answers `turns` times with n_tokens tokens (a function of the episode
    and its turn) and then ends the episode; sleep(i) -> seconds to wait first."""
    calls, lock = {}, threading.Lock()

    def on_turn(i, turn_ids, reason):
        with lock:
            k = calls.setdefault(i, [])
            k.append((list(turn_ids), reason, time.perf_counter()))
        if sleep is not None:
            time.sleep(sleep(i))
        return [200 + (i * 7 + len(k) * 3 + t) % 50 for t in range(n_tokens)] if len(k) <= turns else None

    on_turn.calls = calls
    return on_turn


def _positions(llm):
    """Record, per sequence, every token position a step computes."""
    seen, launch = {}, llm.runner.launch

    def spy(batch):
        for s, n in zip(batch.seqs, batch.num_tokens):
            seen.setdefault(s.seq_id, []).extend(range(s.num_computed_tokens, s.num_computed_tokens + n))
        return launch(batch)

    llm.runner.launch = spy
    return seen


def _turns(ep: Episode) -> list[tuple[int, int]]:
    """[a, b) of each model turn in ep.ids."""
    out, a = [], None
    for t, m in enumerate(ep.model_mask + [0]):
        if m and a is None:
            a = t
        elif not m and a is not None:
            out.append((a, t))
            a = None
    return out


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "sync"])
def test_turns_resume_with_env_tokens_computed_once(exact, lookahead):
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4, async_scheduling=lookahead)
    seen = _positions(llm)
    on_turn = env(turns=2)
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=3, stop_token_ids=list(range(0, 257, 9)), logprobs=True)
    eps = llm.run_episodes(STARTS, sp, on_turn)
    assert [e.index for e in eps] == [0, 1, 2, 3] and [e.start_ids for e in eps] == STARTS
    reasons = set()
    for e in eps:
        assert e.turns == 3 and e.finish_reason in ("stop", "length") and e.error is None
        assert len(e.ids) == len(e.model_mask) == len(e.logprobs)
        spans = _turns(e)
        assert len(spans) == 3
        got = on_turn.calls[e.index]
        for (a, b), (turn, reason, _) in zip(spans, got):
            assert e.ids[a:b] == turn and 1 <= b - a <= 6
            assert reason == ("stop" if turn[-1] % 9 == 0 else "length") and (b - a == 6 or reason == "stop")
            reasons.add(reason)
        for (_, b), k in zip(spans, range(2)):  # the env's tokens follow each turn but the last
            env_ids = [200 + (e.index * 7 + (k + 1) * 3 + t) % 50 for t in range(3)]
            assert e.ids[b:b + 3] == env_ids and e.model_mask[b:b + 3] == [0] * 3 and e.logprobs[b:b + 3] == [0.0] * 3
        assert all(lp < 0 for lp, m in zip(e.logprobs, e.model_mask) if m)
    assert reasons == {"stop", "length"}
    # token in, token out: every position of every episode computed exactly once (no recompute)
    for pos in seen.values():
        assert sorted(pos) == list(range(len(pos)))
    for e, pos in zip(eps, seen.values()):  # the last token too when a step in flight computed it in vain
        assert len(e.start_ids) + len(e.ids) - len(pos) in ((0, 1) if lookahead else (1,))
    st = llm.stats["episodes"]
    assert st["turns"] == 12 and st["env_tokens"] == 24 and st["errors"] == 0
    assert llm.stats["output_tokens"] == sum(e.num_model_tokens for e in eps)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    assert not llm.scheduler.parked and not llm.scheduler.ready


def test_slow_callback_does_not_stop_the_others(exact):
    """Episode 0's environment sleeps 0.5 s at each turn; the three others run all their turns
    (each answered at once) in that time."""
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    on_turn = env(turns=3, sleep=lambda i: 0.5 if i == 0 else 0.0)
    t0 = time.perf_counter()
    eps = llm.run_episodes(STARTS, SP, on_turn, max_workers=4)
    first_sleep_end = on_turn.calls[0][0][2] + 0.5
    for i in (1, 2, 3):
        assert eps[i].turns == 4 and on_turn.calls[i][-1][2] < first_sleep_end
    assert eps[0].turns == 4 and time.perf_counter() - t0 >= 1.5 and eps[0].env_time_s >= 1.5
    assert llm.stats["episodes"]["env_wait_s"] > 1.0  # at the end only episode 0 was left


def test_errors_end_one_episode(exact):
    boom = RuntimeError("tool crashed")

    def on_turn(i, turn_ids, reason):
        if i == 1:
            raise boom
        return {0: [3, 4], 2: [], 3: [5, 999]}.get(i) if not on_turn.once.get(i) else None

    on_turn.once = {}
    orig = on_turn

    def wrapped(i, turn_ids, reason):
        out = orig(i, turn_ids, reason)
        on_turn.once[i] = True
        return out

    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    eps = llm.run_episodes(STARTS, SP, wrapped)
    assert eps[0].finish_reason == "length" and eps[0].turns == 2 and eps[0].error is None
    assert eps[1].finish_reason == "error" and eps[1].error is boom and eps[1].turns == 1
    assert eps[2].finish_reason == "error" and "non-empty list" in str(eps[2].error)
    assert eps[3].finish_reason == "error" and "token id 999" in str(eps[3].error)
    assert llm.stats["episodes"]["errors"] == 3
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    with pytest.raises(InvalidRequestError, match="request 1: empty prompt"):
        llm.run_episodes([[1, 2], []], SP, wrapped)
    with pytest.raises(ValueError, match="max_turns"):
        llm.run_episodes([[1, 2]], SP, wrapped, max_turns=0)
    with pytest.raises(TypeError, match="on_turn"):
        llm.run_episodes([[1, 2]], SP, None)


def test_limits(exact):
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    eps = llm.run_episodes(STARTS, SP, env(turns=10), max_turns=3)
    assert all(e.turns == 3 and e.finish_reason == "max_turns" and e.model_mask[-1] == 1 for e in eps)
    eps = llm.run_episodes(STARTS, SP, env(turns=10, n_tokens=4), max_episode_tokens=17)
    for e in eps:  # 6 + 4 + 6 = 16: no room for the next 4 env tokens and one sampled token
        assert e.finish_reason == "length" and len(e.ids) == 16 and e.turns == 2
    eps = llm.run_episodes(STARTS, SP, env(turns=10, n_tokens=4), max_episode_tokens=13)
    for e in eps:  # the second turn is cut at 13 tokens
        assert e.finish_reason == "length" and len(e.ids) == 13 and e.turns == 2


def test_runs_repeat_and_groups_share_their_start(exact):
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    seen = _positions(llm)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=8, logprobs=True)
    a = llm.run_episodes(STARTS[:2], sp, env(turns=2))
    assert [(e.start_index, e.sample_index) for e in a] == [(i, j) for i in range(2) for j in range(3)]
    assert len({tuple(e.ids) for e in a}) == 6  # different samples
    assert sum(len(p) for p in seen.values()) == sum(len(s) for s in STARTS[:2]) + sum(len(e.ids) - 1 for e in a)
    b = llm.run_episodes(STARTS[:2], sp, env(turns=2, sleep=lambda i: 0.01 * (i % 3)))
    assert [(e.ids, e.logprobs) for e in a] == [(e.ids, e.logprobs) for e in b]


def _forward_logprobs(model, ep, temperature):
    tokens = torch.tensor(ep.start_ids + ep.ids)
    cu = torch.tensor([0, len(tokens)], dtype=torch.int32)
    lp = model.forward(tokens, cu, temperature=temperature, grad=False)
    return lp[len(ep.start_ids):]


def test_exact_logprobs_equal_the_trainer_forward(exact):
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0.8, max_tokens=7, seed=5, stop_token_ids=list(range(0, 257, 11)), logprobs=True)
    eps = llm.run_episodes(STARTS, sp, env(turns=2, n_tokens=5))
    for e in eps:
        assert e.turns == 3
        lp = _forward_logprobs(exact, e, 0.8)
        m = torch.tensor(e.model_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(e.logprobs)[m], lp[m])


def test_exact_turns_equal_a_from_scratch_generate(exact):
    """Greedy: each turn is what generate() of start + everything before the turn gives, tokens
    and logprobs."""
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)
    eps = llm.run_episodes(STARTS, sp, env(turns=2))
    for e in eps:
        for a, b in _turns(e):
            out = llm.generate([e.start_ids + e.ids[:a]], sp, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == e.ids[a:b] and out.logprobs == e.logprobs[a:b]


def test_parked_sequences_are_preempted_and_recomputed(exact):
    """A pool of 20 blocks of 4 for 4 episodes of 44 tokens after starts of 3 to 30, episode 0's environment slow:
    parked sequences give their blocks up, are recomputed when they resume, and the episodes are
    those of a roomy pool, bit for bit."""
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=4, logprobs=True)
    roomy = LLM(exact, enforce_eager=True, num_kv_blocks=128, block_size=4)
    want = roomy.run_episodes(STARTS, sp, env(turns=3, n_tokens=4))
    assert roomy.stats["preemptions"] == 0
    tight = LLM(exact, enforce_eager=True, num_kv_blocks=20, block_size=4)  # 80 tokens: the longest fits
    evicted, evict = [], tight.scheduler._evict_idle
    tight.scheduler._evict_idle = lambda keep=None: evicted.append(evict(keep)) or evicted[-1]
    got = tight.run_episodes(STARTS, sp, env(turns=3, n_tokens=4, sleep=lambda i: 0.05 * (i == 0)))
    assert tight.stats["preemptions"] > 0 and any(evicted)  # idle (parked or resumed) sequences among them
    assert [(e.ids, e.logprobs, e.finish_reason) for e in got] == [(e.ids, e.logprobs, e.finish_reason) for e in want]
    assert tight.block_manager.num_free == 20


def test_few_rows_and_chunked_resumes_change_nothing(exact):
    """max_num_seqs=2 (resumed episodes wait for a row with their blocks kept) and a budget of 5
    tokens a step (a resume's tokens prefill in chunks): the episodes of a roomy engine, bit for bit."""
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=9, logprobs=True)
    want = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4).run_episodes(STARTS, sp, env(turns=2))
    small = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=5)
    got = small.run_episodes(STARTS, sp, env(turns=2, n_tokens=3, sleep=lambda i: 0.02 * (i % 2)))
    assert max(n for n, *_ in small.stats["step_log"]) <= 5 and max(s for _, s, *_ in small.stats["step_log"]) <= 2
    assert [(e.ids, e.logprobs) for e in got] == [(e.ids, e.logprobs) for e in want]


def test_episodes_with_lora_adapters(exact):
    """Each episode with its adapter (or the base): its model tokens' logprobs are the forward's
    with that adapter attached, bit for bit."""
    from rlcu.model.lora import LoraAdapters, LoraConfig

    ads = {}
    for name, seed in (("a", 1), ("b", 2)):
        ad = ads[name] = LoraAdapters.create(exact.cfg, LoraConfig(r=3, alpha=5, target_modules="all-linear"),
                                             exact.device, exact.dtype)
        ad.flat.copy_(torch.randn(ad.flat.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4, lora=ads)
    names = ["a", "base", "b", "a"]
    eps = llm.run_episodes(STARTS, SP, env(turns=2), lora=names)
    try:
        for e, name in zip(eps, names):
            exact.lora = ads.get(name)
            m = torch.tensor(e.model_mask, dtype=torch.bool)
            assert e.turns == 3 and torch.equal(torch.tensor(e.logprobs)[m], _forward_logprobs(exact, e, 1.0)[m])
    finally:
        exact.lora = None
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'c'"):
        llm.run_episodes(STARTS[:1], SP, env(), lora="c")


def test_yields_change_nothing(exact):
    """generate's yield protocol through run_episodes: every third step the engine gives the device
    back (running, ready and parked sequences all free their blocks, the pool is released), and
    the episodes are those of an uninterrupted call, bit for bit."""
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=2, logprobs=True)
    llm = LLM(exact, enforce_eager=True, num_kv_blocks=64, block_size=4)
    want = llm.run_episodes(STARTS, sp, env(turns=2, sleep=lambda i: 0.01 * (i % 2)), max_turns=3)
    asked, yielded, parked, lefts = [0], [], [], []

    def on_yield(left):
        yielded.append((llm.asleep, llm.runner.kv is None))
        parked.append(len(llm.scheduler.parked))
        lefts.append((left, len(llm.scheduler.parked)))

    got = llm.run_episodes(STARTS, sp, env(turns=2, sleep=lambda i: 0.01 * (i % 2)),
                           yield_check=lambda: (asked.__setitem__(0, asked[0] + 1), asked[0] % 3 == 0)[1],
                           on_yield=on_yield, on_done=lambda: yielded.append("done"), max_turns=3)
    assert llm.stats["yields"] >= 3 and yielded[-1] == "done" and set(yielded[:-1]) == {(True, True)}
    assert max(parked) > 0  # some yields found episodes parked
    # the work asked again: the unfinished episodes' turns left of 6 tokens, parked ones' too (so it
    # only falls as turns end)
    left = [w for w, _ in lefts]
    print("LEFTS", lefts)
    assert 0 < left[-1] and left[0] <= 3 * 6 * len(STARTS) and left == sorted(left, reverse=True)
    assert [(e.ids, e.logprobs) for e in got] == [(e.ids, e.logprobs) for e in want]
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_bench_quick_runs(tmp_path):
    """bench/episodes.py --quick, the H200 benchmark's CPU smoke run: both runs, their ratio."""
    import json

    from bench import episodes as bench

    assert bench.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "episodes_quick.json").read_text())
    assert r["episodes"]["model_tokens"] == r["single_turn"]["model_tokens"] == 8 * 4 * 16
    assert r["episodes"]["env_tokens"] == 8 * 3 * 16 and r["ratio"] > 0
