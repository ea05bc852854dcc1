#!/usr/bin/env bash
# Provision from PyPI (reused when present), then extract hidden states from an embedded tiny
# Qwen3-MoE model at tensor_parallel_size=2 on CPU with the untouched speculators generator and
# check them against Hugging Face transformers.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/provision.sh"
source "${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/env.sh"
SPEC_DIR="${SPEC_COMPAT_SPECULATORS%%,*}"; SPEC_DIR="${SPEC_DIR#*=}"
cd "$REPO"
PYTHONPATH="$SPEC_DIR${PYTHONPATH:+:$PYTHONPATH}" exec "$SPEC_COMPAT_VENV/bin/python" tools/demo.py "$@"
