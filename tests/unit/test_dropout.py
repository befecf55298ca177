"""ops/dropout.py: the mask from a seed in device memory. The kernel (interpreted on the CPU)
against its twin bit for bit at odd shapes in fp32 and bf16; the kept fraction; the mask a
function of the seed tensor's content, each stream its own; the refusals."""

import os
import warnings

import pytest
import torch

from rlcu.ops.dropout import dropout_mask, dropout_mask_ref, dropout_mask_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it without a GPU


def seed(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before triton is imported")
@pytest.mark.parametrize("N, K, p", [(7, 33, 0.1), (63, 96, 0.3), (1, 1, 0.5), (5, 2000, 0.05)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_twin(monkeypatch, N, K, p, dtype):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    warnings.filterwarnings("ignore", "overflow", RuntimeWarning)
    for s, stream in ((0, 0), (123456789012345, 5), ((1 << 62) - 1, 2**32 - 1)):
        a = dropout_mask(seed(s), stream, p, N, K, dtype)
        assert torch.equal(a, dropout_mask_ref(seed(s), stream, p, N, K, dtype)), (s, stream)
    assert dropout_mask.kernel is dropout_mask_triton


def test_kept_fraction_and_scale():
    for p in (0.05, 0.3, 0.9):
        m = dropout_mask(seed(7), 11, p, 300, 333, torch.float32)
        kept = m != 0
        assert abs(float(kept.float().mean()) - (1 - p)) < 0.01, p
        assert torch.all(m[kept] == torch.tensor(1 / (1 - p), dtype=torch.float32))
    assert torch.all(dropout_mask(seed(7), 11, 0.0, 4, 5, torch.float32) == 1)


def test_the_mask_is_the_seed_tensors_and_the_streams():
    """What a captured launch reads is the tensor: writing another seed into the same tensor draws
    another mask, the same seed again the same one; streams (layer, module, slice) differ."""
    t = seed(3)
    a = dropout_mask(t, 0, 0.5, 40, 50, torch.float32)
    t.fill_(4)
    b = dropout_mask(t, 0, 0.5, 40, 50, torch.float32)
    t.fill_(3)
    assert not torch.equal(a, b) and torch.equal(a, dropout_mask(t, 0, 0.5, 40, 50, torch.float32))
    assert not torch.equal(a, dropout_mask(t, 1, 0.5, 40, 50, torch.float32))
    # rows are counted row-major: a padded batch's first rows draw the unpadded batch's masks
    assert torch.equal(a, dropout_mask(t, 0, 0.5, 64, 50, torch.float32)[:40])


@pytest.mark.parametrize("args, msg", [
    ((torch.tensor([1], dtype=torch.int32), 0, 0.1), "seed must be one int64"),
    ((seed(1), -1, 0.1), "stream must be in"),
    ((seed(1), 0, 1.0), "p must be in"),
])
def test_refusals(args, msg):
    with pytest.raises(ValueError, match=msg):
        dropout_mask(*args, 3, 4, torch.float32)
