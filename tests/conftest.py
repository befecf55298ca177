import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
