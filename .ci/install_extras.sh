#!/usr/bin/env bash
# The optional pieces the tests exercise, installed only when missing:
# - TRL and the wheels it needs beyond what `.[test]` brings (transformers, ray's requests,
#   matplotlib's dateutil), pinned and with --no-deps, so that they never replace torch or
#   transformers (tests/integration/test_sched_trl.py; tested with trl 1.16.0);
# - Debian's chromium for the dashboard's browser test (tests/integration/test_sched_dashboard.py).
# A failure here only makes those tests skip (they say why).
set -uo pipefail
PY=${PY:-python3}
missing=$("$PY" - <<'PYEOF'
import importlib.util
for mod, spec in [("trl", "trl==1.16.0"), ("accelerate", "accelerate==1.15.0"), ("datasets", "datasets==5.2.0"),
                  ("dill", "dill==0.4.1"), ("multiprocess", "multiprocess==0.70.19"), ("pandas", "pandas==3.1.1"),
                  ("pyarrow", "pyarrow==26.0.1"), ("psutil", "psutil==7.2.2"), ("xxhash", "xxhash==4.1.0")]:
    if importlib.util.find_spec(mod) is None:
        print(spec)
PYEOF
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps $missing || echo "install_extras: could not install $missing (the TRL test will skip)"
fi
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "install_extras: could not install chromium (the dashboard's browser tests will skip)"
fi
exit 0
