"""The two-half decode step (engine/decode_overlap.py) on the CPU: its halves, when a step is
split, and that it computes the rows of the serial forward (paged_forward.hidden)."""

import pytest
import torch

from rlcu import Qwen3, Qwen3Config
from rlcu.engine import paged_forward
from rlcu.engine.decode_overlap import MIN_ROWS, hidden_decode, overlapped, split_rows
from rlcu.ops.exact import is_exact, set_exact

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_split_rows():
    for n in (16, 64, 80, 128, 256):
        assert split_rows(n) == n // 2  # graph buckets: multiples of 16 split evenly
    assert split_rows(72) == 40 and split_rows(1) == 1 and split_rows(9) == 8
    assert all(0 < split_rows(n) <= n and split_rows(n) % 8 == 0 for n in range(8, 300))


def test_which_steps_are_split():
    assert overlapped(MIN_ROWS) and overlapped(256) and not overlapped(MIN_ROWS - 1)
    was = is_exact()
    try:
        set_exact(True)
        assert not overlapped(256)  # exact mode keeps its one batch-invariant forward
    finally:
        set_exact(was)


def _decode_step(S=20, BS=4, seed=0):
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = Qwen3.from_config(cfg, seed=seed, init_std=0.05)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (S,), generator=g, dtype=torch.int32)
    W = 10
    nb = S * W
    kv = torch.randn(2, cfg.num_hidden_layers, nb, BS, 2, 16, generator=g)
    tables = torch.randperm(nb, generator=g).int().view(S, W)
    ids = torch.randint(0, 96, (S,), generator=g, dtype=torch.int32)
    pos = lens - 1
    # each row writes its new K/V to its own slot, as a decode step does
    kv_slots = tables.gather(1, (pos // BS).long()[:, None])[:, 0].long() * BS + pos.long() % BS
    cu = torch.arange(S + 1, dtype=torch.int32)
    return model, kv, (ids, pos, kv_slots, tables, cu, lens)


@pytest.mark.parametrize("S", [20, 64, 9])
def test_two_halves_compute_the_serial_rows(S):
    model, kv, (ids, pos, kv_slots, tables, cu, lens) = _decode_step(S)
    kv2 = kv.clone()
    want = paged_forward.hidden(model, kv, ids, pos, kv_slots, tables, cu, lens, 1, 40)
    got = hidden_decode(model, kv2, ids, pos, kv_slots, tables, cu, lens, 40, side=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv2, kv, rtol=1e-5, atol=1e-5)  # the same K/V written to the same slots
    assert not torch.equal(kv2, _decode_step(S)[1])  # (and something was written)


def test_each_half_reads_only_its_own_sequences():
    """A second half's rows do not change when the first half's sequences change."""
    model, kv, (ids, pos, kv_slots, tables, cu, lens) = _decode_step(32)
    a = hidden_decode(model, kv.clone(), ids, pos, kv_slots, tables, cu, lens, 40, side=None)
    ids2, lens2 = ids.clone(), lens.clone()
    ids2[:16] = (ids2[:16] + 1) % 96
    lens2[:16] = torch.clamp(lens2[:16] - 3, min=1)
    b = hidden_decode(model, kv.clone(), ids2, lens2 - 1, kv_slots, tables, cu, lens2, 40, side=None)
    torch.testing.assert_close(b[16:], a[16:], rtol=0, atol=0)
    assert not torch.allclose(b[:16], a[:16])
