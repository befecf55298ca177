"""`python bench/X.py` puts bench/ first on sys.path, so a bench module named like a package that
transformers, TRL or PEFT probe for (importlib's find_spec) is found in its place and imported by
them: bench/kernels.py once stood in for HF's `kernels` package and broke every TRL peer side
(ImportError inside transformers' hub_kernels). No bench module may take such a name."""

import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _probed() -> set[str]:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    text = Path(import_utils.__file__).read_text()
    names = set(re.findall(r"_is_package_available\(\s*\"([A-Za-z0-9_]+)\"", text))
    assert len(names) > 20, "transformers' probes not found: the pattern needs a look"
    return names


def test_no_bench_module_shadows_a_package_transformers_probes():
    probed = _probed() | {"trl", "peft", "datasets", "accelerate", "vllm", "liger_kernel", "deepspeed"}
    clash = sorted(p.stem for p in BENCH.glob("*.py") if p.stem in probed)
    assert not clash, f"bench/{clash[0]}.py shadows the package `{clash[0]}` under `python bench/...`"
    assert "kernels" in probed  # the name that broke the TRL sides stays checked
