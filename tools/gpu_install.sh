#!/usr/bin/env bash
# Install the bundle made by tools/gpu_bundle.py on the device machine (no network there).
#
#   bash tools/gpu_install.sh --stash [BUNDLE_DIR]   # a transfer call: keep the carried part
#   bash tools/gpu_install.sh [BUNDLE_DIR]           # the last call: keep it, then install
#   . /tmp/sc/env.sh                                 # the exports it prints (PYTHONPATH etc.)
#
# BUNDLE_DIR (default /tmp/sc_bundle) accumulates the parts (sc_bundle.tar.xz.partNN),
# manifest.json and SHA256SUMS, one part per device call: each call carries
# build/gpu_parts/p<i>/ (staged by `python tools/gpu_bundle.py --stage`), and both forms first
# copy every build/gpu_parts/p*/ present into BUNDLE_DIR. The install checks every part's sha256, joins them, checks
# the joined sha256, unpacks, and installs with pip --no-index --no-deps --no-compile --target:
# vLLM and its dependencies into $SITE, speculators 0.4.0.1 into $SITE_SPEC_04 and 0.3.0 into
# $SITE_SPEC_03. spec_compat itself is used from this repository's src/ (on PYTHONPATH), and a
# spec_compat dist-info written into $SITE makes its vllm.general_plugins entry point visible to
# vLLM's worker processes (entry points are only found through a dist-info).
# Rerunning with the same bundle reuses the install (marker file), so it is cheap to repeat.
#
# Environment (all optional): SC_ROOT (default /tmp/sc), SITE, SITE_SPEC_04, SITE_SPEC_03,
# SC_ENV_FILE (default $SC_ROOT/env.sh), PYTHON (default python3).
set -euo pipefail

STASH_ONLY=0
if [ "${1:-}" = "--stash" ]; then STASH_ONLY=1; shift; fi
BUNDLE_DIR="${1:-${SC_BUNDLE_DIR:-/tmp/sc_bundle}}"
SC_ROOT="${SC_ROOT:-/tmp/sc}"
SITE="${SITE:-$SC_ROOT/site}"
SITE_SPEC_04="${SITE_SPEC_04:-$SC_ROOT/spec-0.4.0.1}"
SITE_SPEC_03="${SITE_SPEC_03:-$SC_ROOT/spec-0.3.0}"
ENV_FILE="${SC_ENV_FILE:-$SC_ROOT/env.sh}"
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MARKER="$SC_ROOT/.installed"
say() { echo "[gpu_install] $*"; }
started=$SECONDS

# Keep whatever parts this call carried (one folder per part; never one cp over several folders:
# their manifest.json files have the same name).
mkdir -p "$BUNDLE_DIR"
for staged in "$REPO"/build/gpu_parts/p*/; do
  [ -d "$staged" ] || continue
  cp -p "$staged"* "$BUNDLE_DIR"/
  say "kept $(cd "$staged" && ls *.part* 2>/dev/null | tr '\n' ' ')-> $BUNDLE_DIR"
done
[ -f "$BUNDLE_DIR/manifest.json" ] || { say "no manifest.json in $BUNDLE_DIR"; exit 2; }
parts_state() {
  "$PY" - "$BUNDLE_DIR" <<'PYCODE'
import json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
have = [p["name"] for p in m["parts"] if os.path.isfile(os.path.join(d, p["name"]))]
print(f"{len(have)}/{len(m['parts'])}", " ".join(p["name"] for p in m["parts"] if p["name"] not in have))
PYCODE
}
if [ "$STASH_ONLY" = 1 ]; then
  read -r count missing_parts <<<"$(parts_state)"
  say "$BUNDLE_DIR holds $count parts; missing: ${missing_parts:-none} ($(df -h "$BUNDLE_DIR" | awk 'NR==2 {print $4}') free)"
  exit 0
fi
manifest_field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["joined"][sys.argv[2]])' \
  "$BUNDLE_DIR/manifest.json" "$1"; }
JOINED_NAME="$(manifest_field name)"
JOINED_SHA="$(manifest_field sha256)"
mkdir -p "$SC_ROOT"

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$JOINED_SHA" ]; then
  say "bundle $JOINED_SHA already installed in $SC_ROOT"
else
  # 1. every part present and intact
  read -r count missing <<<"$(parts_state)"
  if [ -n "${missing:-}" ]; then
    say "missing parts in $BUNDLE_DIR ($count present): $missing"
    say "(a machine left idle for 30 s is given back and /tmp starts empty: send the parts again, back to back)"
    exit 2
  fi
  (cd "$BUNDLE_DIR" && sha256sum --quiet -c SHA256SUMS) || { say "a part is corrupt (sha256 mismatch)"; exit 3; }
  say "parts verified ($(cd "$BUNDLE_DIR" && wc -l < SHA256SUMS) parts)"

  # 2. join in manifest order, check the whole
  JOINED="$SC_ROOT/$JOINED_NAME"
  "$PY" - "$BUNDLE_DIR" "$JOINED" <<'PYCODE'
import json, os, shutil, sys
d, out = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(d, "manifest.json")))
with open(out, "wb") as dst:
    for p in m["parts"]:
        with open(os.path.join(d, p["name"]), "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 22)
PYCODE
  echo "$JOINED_SHA  $JOINED" | sha256sum --quiet -c - || { say "joined bundle sha256 mismatch"; exit 3; }
  say "joined $JOINED_NAME ($(du -m "$JOINED" | cut -f1) MiB), sha256 ok"

  # 3. unpack (xz's threads when present, Python's lzma otherwise)
  UNPACKED="$SC_ROOT/unpacked"
  rm -rf "$UNPACKED" && mkdir -p "$UNPACKED"
  if command -v xz >/dev/null 2>&1; then
    xz -dc -T0 "$JOINED" | tar -x -C "$UNPACKED"
  else
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$JOINED" "$UNPACKED"
  fi
  rm -f "$JOINED"
  say "unpacked: $(ls "$UNPACKED"/wheels | wc -l) wheels + speculators $(ls -d "$UNPACKED"/spec-* | xargs -n1 basename | tr '\n' ' ')"

  # 4. install
  pip_target() {
    local target="$1"; shift
    rm -rf "$target"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$target" "$@"
  }
  pip_target "$SITE" "$UNPACKED"/wheels/*.whl
  pip_target "$SITE_SPEC_04" "$UNPACKED"/spec-0.4.0.1/*.whl
  pip_target "$SITE_SPEC_03" "$UNPACKED"/spec-0.3.0/*.whl
  rm -rf "$UNPACKED"
  echo "$JOINED_SHA" > "$MARKER"
  say "installed into $SITE, $SITE_SPEC_04, $SITE_SPEC_03"
fi

# 4b. wheels carried beside the bundle (build/gpu_extra/, e.g. humming-kernels + pyelftools, which
#     vLLM 0.22.1's quantization registry imports for any quantized checkpoint), added on every call
if compgen -G "$REPO/build/gpu_extra/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --upgrade --target "$SITE" "$REPO"/build/gpu_extra/*.whl
  say "added $(ls "$REPO"/build/gpu_extra/*.whl | xargs -n1 basename | tr '\n' ' ')"
fi

# 5. spec_compat from this repository: src/ on PYTHONPATH, plus a dist-info in $SITE that carries
#    its entry points (vllm.general_plugins), generated from pyproject.toml.
"$PY" - "$REPO" "$SITE" <<'PYCODE'
import pathlib, shutil, sys, tomllib
repo, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
name, version = project["name"].replace("-", "_"), project["version"]
for old in site.glob(f"{name}-*.dist-info"):
    shutil.rmtree(old)
info = site / f"{name}-{version}.dist-info"
info.mkdir(parents=True)
meta = [f"Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}"]
meta += [f"Requires-Dist: {r}" for r in project.get("dependencies", [])]
(info / "METADATA").write_text("\n".join(meta) + "\n")
groups = project.get("entry-points", {})
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
(info / "entry_points.txt").write_text(text)
(info / "top_level.txt").write_text("spec_compat\n")
(info / "INSTALLER").write_text("gpu_install.sh\n")
(info / "direct_url.json").write_text('{"url": "file://%s", "dir_info": {"editable": true}}\n' % repo)
files = ["METADATA", "entry_points.txt", "top_level.txt", "INSTALLER", "direct_url.json", "RECORD"]
(info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files))
print(f"[gpu_install] spec_compat {version}: {repo / 'src'} (entry points: {', '.join(groups) or 'none'})")
PYCODE

cat > "$ENV_FILE" <<ENV
export SITE="$SITE"
export SITE_SPEC_04="$SITE_SPEC_04"
export SITE_SPEC_03="$SITE_SPEC_03"
export PYTHONPATH="$SITE:$REPO/src\${PYTHONPATH:+:\$PYTHONPATH}"
export SPEC_COMPAT_SPECULATORS="0.4.0.1=$SITE_SPEC_04,0.3.0=$SITE_SPEC_03"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
ENV

# 6. requirements of everything in $SITE, checked against what this interpreter now sees
#    (non-fatal: optional CUDA kernel packages are left out on purpose).
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SITE" <<'PYCODE' || true
import importlib.metadata as md, pathlib, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
site = pathlib.Path(sys.argv[1])
optional = {"flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cudnn-frontend", "fastsafetensors",
            "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels", "opentelemetry-sdk",
            "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai"}
unmet = []
for dist in md.distributions(path=[str(site)]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in optional:
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{dist.metadata['Name']} -> {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist.metadata['Name']} -> {req}: have {have}")
print(f"[gpu_install] requirement check: {len(unmet)} unmet (optional kernel packages not counted)")
for line in sorted(unmet)[:60]:
    print(f"[gpu_install]   {line}")
PYCODE

say "done in $((SECONDS - started)) s; exports (also in $ENV_FILE):"
sed 's/^/    /' "$ENV_FILE"
