import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the helpers: `from support.x import ...`

# Triton decides at decoration time whether kernels are interpreted, so this must be set
# before anything imports triton: without a GPU, kernel tests run through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from rlcu.ops._backend import patch_triton_interpreter

    patch_triton_interpreter()  # numpy >= 2.4 (the library applies it too, when TRITON_INTERPRET=1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    # tests choose their backend explicitly; an RLCU_BACKEND from the shell must not leak in
    if "RLCU_BACKEND" in os.environ and not os.environ.get("RLCU_TEST_KEEP_BACKEND"):
        monkeypatch.delenv("RLCU_BACKEND")


@pytest.fixture
def one_thread():
    """torch on one thread: tiny shapes gain nothing from threads, and on the 2-core CI machine
    extra threads only oversubscribe it (test files opt in with usefixtures)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def keep_threads(monkeypatch):
    """For tests of rlcu.threads: whatever a test sets, the process gets its count back; no
    torchrun or OMP variable leaks in, and the machine's idle cores are the test's to say."""
    from rlcu import threads as th

    n = torch.get_num_threads()
    for k in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(th, "idle_cores", lambda: None)
    yield
    torch.set_num_threads(n)
