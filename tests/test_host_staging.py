"""engine/host_staging.py: a step's inputs packed into one aligned buffer and copied from pinned
memory, so that the host does not wait for the device (the lookahead's premise)."""

import time

import numpy as np
import pytest
import torch

from rlcu.engine.host_staging import HostStaging


def _arrays(rng, dtype, lens):
    return [rng.integers(-5, 1000, n).astype(dtype) for n in lens]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32])
def test_pack_gives_each_array_aligned_on_the_device(dtype):
    rng = np.random.default_rng(0)
    st = HostStaging(torch.device("cpu"))
    xs = _arrays(rng, dtype, [5, 0, 17, 1])
    out = st.pack(xs, dtype)
    for x, t in zip(xs, out):
        assert t.shape == (len(x),) and t.dtype == torch.from_numpy(x).dtype
        assert np.array_equal(t.numpy(), x)
        assert t.data_ptr() % 16 == 0


def test_cpu_packs_do_not_share_memory():
    """On the CPU the 'device' views are the host buffer itself: a later pack must not overwrite
    an earlier step's inputs."""
    st = HostStaging(torch.device("cpu"), depth=2)
    first = [st.pack([np.arange(4, dtype=np.int64) + 10 * k], np.int64)[0] for k in range(5)]
    for k, t in enumerate(first):
        assert t.tolist() == [10 * k + i for i in range(4)]


@pytest.mark.gpu
def test_gpu_pack_neither_waits_for_the_device_nor_overwrites_a_copy_in_flight():
    """With the stream busy (a 0.3 s sleep kernel), packing a prefill step's inputs (8192 tokens'
    ids and slots, a 256 x 64 block table) returns at once, and each pack of a ring that wraps
    around several times arrives intact."""
    dev = torch.device("cuda")
    st = HostStaging(dev, depth=3)
    rng = np.random.default_rng(1)
    st.pack(_arrays(rng, np.int64, [8192]), np.int64)  # the first pinned allocations
    torch.cuda.synchronize()
    sent, got = [], []
    torch.cuda._sleep(int(0.3 * 1.5e9))  # ~0.3 s of the stream at ~1.5 GHz
    t0 = time.perf_counter()
    for _ in range(7):
        xs = _arrays(rng, np.int64, [8192, 8192, 256]) + _arrays(rng, np.int32, [8192, 257, 256 * 64])
        got.append(st.pack(xs[:3], np.int64) + st.pack(xs[3:], np.int32))
        sent.append(xs)
        if len(got) == 1:
            host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    # the old path, for the record: a pageable buffer of the same size
    torch.cuda._sleep(int(0.3 * 1.5e9))
    t1 = time.perf_counter()
    torch.from_numpy(np.zeros(3 * 8192 + 256, dtype=np.int64)).to(dev, non_blocking=True)
    print(f"pack with the stream busy: {1e3 * host_s:.2f} ms (pageable copy: {1e3 * (time.perf_counter() - t1):.2f} ms)")
    torch.cuda.synchronize()
    assert host_s < 0.1, f"the first pack took {host_s:.3f} s behind a 0.3 s kernel: it waited for the device"
    for xs, ts in zip(sent, got):
        for x, t in zip(xs, ts):
            assert np.array_equal(t.cpu().numpy(), x)
