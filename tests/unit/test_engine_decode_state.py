"""The decode-step state on its own (engine/decode_state.py) and the continuation rule
(ScheduledBatch.continues), without a model: fields staged from the host, advanced on the
device, block-table entries sent only when they change."""

import torch

from rlcu.engine.decode_state import DecodeState
from rlcu.engine.params import SamplingParams
from rlcu.engine.scheduler import ScheduledBatch
from rlcu.engine.sequence import Sequence

BS = 4


def _seq(prompt_len: int, computed: int, blocks: list[int], sp=None) -> Sequence:
    s = Sequence(0, list(range(1, prompt_len + 1)), sp or SamplingParams(temperature=0.5, top_k=3, seed=1), 7)
    s.num_computed_tokens = computed
    s.block_table = list(blocks)
    return s


def _decode(seqs) -> ScheduledBatch:
    return ScheduledBatch(list(seqs), [1] * len(seqs), [1] * len(seqs), [])


def test_continues_rule():
    a, b = _seq(5, 4, [0, 1]), _seq(3, 2, [2])
    first = _decode([a, b])
    assert _decode([a, b]).continues(first)
    assert not _decode([a, b]).continues(None)
    assert not _decode([b, a]).continues(first)  # same sequences, other rows
    assert not _decode([a]).continues(first)
    assert not _decode([a, b, _seq(2, 1, [3])]).continues(first)
    twin = _seq(5, 4, [0, 1])  # equal content is not the same sequence
    assert not _decode([twin, b]).continues(first)
    prefill = ScheduledBatch([a, b], [1, 2], [1, 1], [])
    assert not prefill.continues(first) and not _decode([a, b]).continues(prefill)
    chunk = ScheduledBatch([a, b], [1, 1], [1, 0], [])  # a non-final chunk samples nothing
    assert not _decode([a, b]).continues(chunk)


def _advance(seqs, samples):
    """What the scheduler does between two decode steps: one token computed and one sampled
    per sequence, a new block when the next token starts one."""
    for s, t in zip(seqs, samples):
        s.token_ids.append(t)
        s.num_computed_tokens += 1
        if s.num_computed_tokens // BS >= len(s.block_table):
            s.block_table.append(40 + len(s.block_table))


def _fields(d, seqs):
    n = len(seqs)
    return {k: d.dev[k][:n].tolist() for k in ("ids", "pos", "lens", "kv_slots", "offsets")}


def _want(seqs):
    return dict(ids=[s.token_ids[s.num_computed_tokens] for s in seqs],
                pos=[s.num_computed_tokens for s in seqs], lens=[s.num_computed_tokens + 1 for s in seqs],
                kv_slots=[s.block_table[s.num_computed_tokens // BS] * BS + s.num_computed_tokens % BS for s in seqs],
                offsets=[len(s.token_ids) - s.num_prompt_tokens for s in seqs])


def test_stage_then_continue_then_invalidate():
    d = DecodeState(rows=4, width=8, block_size=BS, device=torch.device("cpu"))
    a, b = _seq(6, 5, [3, 9]), _seq(2, 1, [4])
    b.lora = 2  # b runs on the engine's adapter slot 2, a on none
    a.token_ids.append(11)  # a has one generated token, not computed yet: offset 1
    a.num_computed_tokens = 6
    seqs, step = [a, b], _decode([a, b])
    assert d.load(step, 4, None) == 7  # staged: the longest context is a's 7 tokens
    assert d.num_continued == 0 and _fields(d, seqs) == _want(seqs)
    assert d.dev["kv_slots"][2:4].tolist() == [-1, -1]  # padding rows write nowhere
    assert d.dev["lora"][:4].tolist() == [-1, 2, -1, -1]  # rows' adapter slots; padding: none
    assert d.block_tables(2, 2).tolist() == [[3, 9], [4, 0]]
    for i in range(6):  # continued: the device advances; b crosses into a new block at token 4
        samples = torch.tensor([20 + i, 30 + i])
        _advance(seqs, samples.tolist())
        step = _decode(seqs)
        assert d.load(step, 2, samples) == 8 + i
        assert d.num_continued == i + 1 and _fields(d, seqs) == _want(seqs), i
        assert d.block_tables(2, 3)[1, :len(b.block_table)].tolist() == b.block_table
        assert d.dev["lora"][:2].tolist() == [-1, 2]  # a continued step keeps its rows' adapters
    b.block_table[-1] = 77  # copy-on-write replaced b's last block: only that entry is sent again
    samples = torch.tensor([1, 2])
    _advance(seqs, samples.tolist())
    d.invalidate()  # the next step is staged from the host, placeholders taken from the samples
    a.token_ids[-1] = -1
    a.pending_row = 0
    assert d.load(_decode(seqs), 2, samples) == a.num_computed_tokens + 1
    assert d.num_continued == 6
    want = _want(seqs)
    want["ids"][0] = 1  # the placeholder's value: row 0 of the last samples
    assert _fields(d, seqs) == want and d.block_tables(2, 3)[1, :len(b.block_table)].tolist() == b.block_table


def test_reset_forgets_tables_and_reuses_them():
    d = DecodeState(rows=1, width=4, block_size=BS, device=torch.device("cpu"))
    seqs = [_seq(2, 1, [i]) for i in range(3)]  # 3 sequences through 2 tables
    for s in seqs:
        d.load(_decode([s]), 1, None)
        assert d.block_tables(1, 1).tolist() == [[s.block_table[0]]]
    assert len(d.table_of) <= d.num_tables == 2
    d.reset()
    assert not d.table_of and d.prev is None
    d.load(_decode([seqs[0]]), 1, None)
    assert d.block_tables(1, 1).tolist() == [[0]]
