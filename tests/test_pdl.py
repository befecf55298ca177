"""ops/pdl.py off the GPU: where a kernel is launched with programmatic dependent launch and
where not (the GPU side, same bits with it and without: test_pdl_gpu.py; the compiled
wait-then-trigger: test_sm90_compile.py)."""

import pytest
import torch

from rlcu.ops import pdl


def test_cpu_tensors_never_take_pdl():
    assert not pdl.available(torch.device("cpu"))
    assert pdl.launch_kw(torch.device("cpu")) == {"PDL": False}


def test_disabled_and_interpreted_launches_take_no_pdl(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(pdl.CONFIGS, "enabled", False)
    assert pdl.launch_kw(cuda) == {"PDL": False}  # decided before any CUDA call
    monkeypatch.setitem(pdl.CONFIGS, "enabled", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.available(cuda)


@pytest.mark.parametrize("cap, want", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_sm90_and_later_take_pdl(monkeypatch, cap, want):
    if pdl.gdc_wait is None:
        pytest.skip("this triton has no grid dependency control")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_CAPABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: cap)
    kw = pdl.launch_kw(torch.device("cuda", 0))
    assert kw == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
