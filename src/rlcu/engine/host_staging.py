"""Host-to-device copies of a step's small arrays (token ids, positions, KV slots, block tables,
sampling parameters) through pinned staging buffers.

A copy from pageable host memory goes through the driver's own staging and can hold the host
until the stream reaches it, that is until the step before has run: the launch of step t + 1
then waits for step t on the device, and the lookahead (engine/step_loop.py) overlaps nothing.
From pinned memory the copy is a DMA queued behind step t, and the host returns at once.

`HostStaging.pack` concatenates 1-D arrays into one buffer (each start 16 bytes aligned, so the
kernels see the same pointer alignment whatever the step's sizes, and Triton compiles no new
variant), copies it with one non-blocking copy and returns the arrays' device views. The pinned
buffers form a ring: a slot is written again `depth` packs later, after the event recorded
behind its copy has completed (with the one-step lookahead a step's copies are long done by
then: a launch makes at most 4 packs and the step two launches back has been read back). On a
CPU device nothing is copied, so each pack gets a fresh array.
"""

from __future__ import annotations

import numpy as np
import torch

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def _layout(arrays: list, dtype) -> tuple[list[int], int]:
    """Each array's start (a multiple of 16 bytes) and the total length, in elements."""
    a = 16 // np.dtype(dtype).itemsize
    starts, n = [], 0
    for x in arrays:
        starts.append(n)
        n += -(-len(x) // a) * a
    return starts, max(n, 1)


class HostStaging:
    """Pinned staging buffers for one device's step inputs (see the module docstring)."""

    def __init__(self, device: torch.device, depth: int = 8):
        self.device, self.depth = torch.device(device), depth
        self.pinned = self.device.type == "cuda"
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * depth
        self._next = 0

    def _host(self, n: int, dtype) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A zeroed host tensor of n elements: a view of the next ring slot (pinned)."""
        if not self.pinned:
            return torch.from_numpy(np.zeros(n, dtype=dtype)), None
        k = self._next
        self._next = (k + 1) % self.depth
        nbytes = n * np.dtype(dtype).itemsize
        slot = self._slots[k]
        if slot is None or slot[0].numel() < nbytes:
            cap = 1 << max(12, (nbytes - 1).bit_length())  # grow by powers of two: few pinned allocations
            slot = (torch.empty(cap, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
            self._slots[k] = slot
        else:
            slot[1].synchronize()  # its last copy has left (at once, but for a bug in the depth)
        host = slot[0][:nbytes].view(_TORCH[np.dtype(dtype)])
        host.zero_()
        return host, slot[1]

    def pack(self, arrays: list, dtype) -> list[torch.Tensor]:
        """1-D arrays -> their views on the device, from one buffer and one non-blocking copy."""
        starts, n = _layout(arrays, dtype)
        host, event = self._host(n, dtype)
        view = host.numpy()
        for x, o in zip(arrays, starts):
            view[o:o + len(x)] = x
        buf = host.to(self.device, non_blocking=True)
        if event is not None:
            event.record()
        return [buf[o:o + len(x)] for x, o in zip(arrays, starts)]
