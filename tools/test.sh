#!/usr/bin/env bash
# Provision from PyPI (reused when present) and run the whole test suite, real engines included.
# --fast: unit and boundary tests and one engine cell (the inner loop). Other arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/provision.sh"
source "${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/env.sh"
cd "$REPO"
# mypy's cache beside the venvs, not in the checkout: a clean clone (CI's) checks in about 2 s instead of
# 50 s on 2 cores; mypy still re-checks every file whose content changed.
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/mypy_cache}"
"$SPEC_COMPAT_VENV/bin/python" -m ruff check src tests tools noxfile.py
"$SPEC_COMPAT_VENV/bin/python" -m ruff format --check src tests tools noxfile.py
"$SPEC_COMPAT_VENV/bin/python" -m mypy
if [ "${1:-}" = "--fast" ]; then
  # The inner loop (a few minutes): unit and boundary tests and one real engine cell; the full run
  # (no --fast) is the default and what CI runs.
  shift
  exec "$SPEC_COMPAT_VENV/bin/python" -m pytest -ra -p no:cacheprovider tests/unit tests/test_boundary.py \
    "tests/test_engine.py::test_generator_matches_hf[spec0.4.0.1-dense-tp1-spawn]" "$@"
fi
# --durations=25: the slowest tests in every full run's log (docs/testing.md keeps them per host).
exec "$SPEC_COMPAT_VENV/bin/python" -m pytest -ra -p no:cacheprovider --durations=25 "$@"
