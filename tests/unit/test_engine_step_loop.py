"""The parts of LLM._run on their own, without a model: request validation and output
assembly (engine/requests.py), the step loop with its lookahead and yield protocol and the
stats it keeps (engine/step_loop.py). A fake runner samples a token from each row's seed
and sample offset, as the real sampler's counter-based draws do, so every way of running
the same requests must give the same tokens."""

import pytest

from rlcu.engine import requests
from rlcu.engine.block_manager import BlockManager
from rlcu.engine.params import InvalidRequestError, SamplingParams
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.step_loop import GenerateStats, StepLoop

V = 10  # small: most samples meet the stop token before their max_tokens
STOP = 3


class FakeRunner:
    """launch -> one token per sample row: a function of (the row's seed, its sample offset)."""

    def __init__(self, fail_at: int | None = None):
        self.launches, self.fail_at = 0, fail_at

    def launch(self, batch):
        self.launches += 1
        if self.launches == self.fail_at:
            raise RuntimeError("device lost")
        toks = []
        for s, ns in zip(batch.seqs, batch.num_samples):
            off = len(s.token_ids) - s.num_prompt_tokens
            toks += [(seed * 7919 + off * 104729) % V for seed in s.sample_seeds()] if ns else []
        return (toks, [-0.5 * t for t in toks]), batch.is_decode

    @staticmethod
    def collect(out):
        return list(out[0]), list(out[1])


PROMPTS = [[5, 17, 3, 8], list(range(10, 31)), [7] * 9, [1]]


def _resolved(prompts=PROMPTS):
    return [({"prompt_token_ids": p}, p, None) for p in prompts]


def _run(lookahead=True, num_blocks=64, yield_every=0, fail_at=None, sp=None):
    sp = sp or [SamplingParams(n=2, max_tokens=m, seed=4 + i, stop_token_ids=[STOP] if i % 2 == 0 else [])
                for i, m in enumerate((12, 12, 11, 7))]
    resolved = _resolved()
    checked, errors = requests.validate(resolved, sp, "raise")
    bm = BlockManager(num_blocks, 4, True)
    sch = Scheduler(bm, 4, 16, min(64, 4 * num_blocks))  # the longest request (33 tokens) fits
    for s in requests.make_sequences(resolved, checked, frozenset()):
        sch.add(s)
    asked = [0]

    def yield_check():
        asked[0] += 1
        return asked[0] % yield_every == 0

    def do_yield():
        sch.preempt_all()
        bm.reset()

    loop = StepLoop(sch, FakeRunner(fail_at), {i: p.n for i, p in checked.items()}, lookahead=lookahead,
                    yield_check=yield_check if yield_every else None, do_yield=do_yield)
    progress = []
    done = loop.run(lambda d, t: progress.append((d, t)))
    outs = requests.assemble(resolved, errors, done)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], loop, progress, bm


def test_lookahead_sync_yield_and_preemption_agree():
    want, loop, progress, _ = _run(lookahead=False)
    st = loop.stats
    assert any(r == "stop" for o in want for _, r in o) and any(r == "length" for o in want for _, r in o)
    assert progress[-1] == (len(PROMPTS), st.output_tokens) and st.yields == 0
    assert st.steps == len(st.step_log) and st.decode_tokens + st.prefill_tokens == sum(x[0] for x in st.step_log)
    assert st.graph_steps == sum(x[3] for x in st.step_log) > 0  # (the fake says decode steps ran a graph)
    got, la, _, _ = _run(lookahead=True)
    assert got == want and la.stats.output_tokens == st.output_tokens
    got, y, _, _ = _run(yield_every=3)
    assert got == want and y.stats.yields > 0
    got, small, _, _ = _run(num_blocks=10)
    assert got == want and small.stats.preemptions > 0


def test_failure_aborts_every_sequence():
    with pytest.raises(RuntimeError, match="device lost"):
        _run(fail_at=4)
    # a fresh loop over the same workload: the abort left no block held
    sp = SamplingParams(n=2, max_tokens=12, seed=4)
    resolved = _resolved()
    checked, _ = requests.validate(resolved, sp, "raise")
    bm = BlockManager(64, 4, True)
    sch = Scheduler(bm, 4, 16, 64)
    for s in requests.make_sequences(resolved, checked, frozenset()):
        sch.add(s)
    with pytest.raises(RuntimeError, match="device lost"):
        StepLoop(sch, FakeRunner(fail_at=3), {i: 2 for i in checked}, lookahead=True).run()
    assert not sch.has_unfinished() and bm.num_free == 64


def test_stats_dict_keys():
    st = GenerateStats()
    assert list(st.as_dict()) == ["steps", "graph_steps", "prefill_tokens", "decode_tokens", "preemptions",
                                  "cached_tokens", "yields", "t_schedule", "t_launch", "t_wait", "t_postprocess",
                                  "t_yield", "step_log", "wall", "output_tokens"]
    st.step_log.append((1, 1, 1, False, 0.0))
    assert GenerateStats().step_log == []  # each call its own log


def test_validate_and_assemble():
    resolved = _resolved([[1, 2], [3]]) + [("bad", None, "empty prompt (it has no tokens)")]
    with pytest.raises(InvalidRequestError) as e:
        requests.validate(resolved, None, "raise")
    assert e.value.errors == {2: "empty prompt (it has no tokens)"}
    with pytest.raises(ValueError, match="on_error"):
        requests.validate(resolved, None, "ignore")
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        requests.validate(resolved, [SamplingParams()] * 2, "return")
    bad = SamplingParams()
    bad.n = 0  # changed after construction: found again
    checked, errors = requests.validate(resolved, [SamplingParams(max_tokens=2), bad, SamplingParams()], "return")
    assert list(checked) == [0] and checked[0].max_tokens == 2 and set(errors) == {1, 2} and "n" in errors[1]
    seqs = requests.make_sequences(resolved, checked, frozenset({9}))
    assert [s.request_id for s in seqs] == [0] and seqs[0].stop_ids == frozenset({9})
    a, b = seqs[0], seqs[0].fork(1)
    b.token_ids += [4, 5]
    a.token_ids += [6]
    a.finish_reason = b.finish_reason = "length"
    outs = requests.assemble(resolved, errors, {0: [b, a]}, decode=lambda ids, skip_special_tokens: str(ids))
    assert [o.request_id for o in outs] == [0, 1, 2] and [o.error is None for o in outs] == [True, False, False]
    assert [(c.index, c.token_ids, c.text) for c in outs[0].outputs] == [(0, [6], "[6]"), (1, [4, 5], "[4, 5]")]
    assert outs[1].outputs == [] and outs[1].prompt_token_ids == [3] and outs[2].prompt_token_ids == []
