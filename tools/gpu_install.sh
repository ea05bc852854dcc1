#!/usr/bin/env bash
# Install the bundle made by tools/gpu_bundle.py on the device machine (no network there).
#
#   bash tools/gpu_install.sh --stash [BUNDLE_DIR]   # a transfer call: keep the carried part
#   bash tools/gpu_install.sh [BUNDLE_DIR]           # the last call: keep it, then install
#   . /tmp/sc/env.sh                                 # the exports it prints (PYTHONPATH etc.)
#   bash tools/gpu_install.sh --release 0.23.0       # later call: another vLLM release on top
#   . /tmp/sc/env-0.23.0.sh                          # ... its exports (release folder first)
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
# Only build/gpu_parts/p*/ belong to this bundle; the release folders (r*/) are left alone.
#
# --release VERSION (after the 0.22.1 bundle was installed by an earlier call of the same warm
# session): copies build/gpu_parts/r<VERSION>/ (or r<VERSION>a/, r<VERSION>b/, ... one per call;
# `--stash --release VERSION` for all but the last) into RELEASE_DIR (default
# /tmp/sc_bundle_<VERSION>), checks, joins and unpacks it the same way, installs its wheels (that
# vLLM and the few dependencies whose versions differ) into $SC_ROOT/site-<VERSION>, writes the
# spec_compat dist-info there too and $SC_ROOT/env-<VERSION>.sh: env.sh with
# PYTHONPATH=$SC_ROOT/site-<VERSION>:$SITE:<repo>/src, so the release's packages (and their
# dist-info, which importlib.metadata reads first) shadow the 0.22.1 ones; SITE is the release
# folder, SC_SITE_BASE the 0.22.1 one. Its own marker ($SC_ROOT/.installed-<VERSION>).
#
# Environment (all optional): SC_ROOT (default /tmp/sc), SITE, SITE_SPEC_04, SITE_SPEC_03,
# SC_ENV_FILE (default $SC_ROOT/env.sh), SC_BUNDLE_DIR (default /tmp/sc_bundle),
# SC_RELEASE_DIR (default /tmp/sc_bundle_<VERSION>), PYTHON (default python3).
set -euo pipefail

STASH_ONLY=0
RELEASE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --stash) STASH_ONLY=1; shift ;;
    --release) RELEASE="${2:?--release needs a vLLM version}"; shift 2 ;;
    --release=*) RELEASE="${1#--release=}"; shift ;;
    *) break ;;
  esac
done
case "$RELEASE" in *[!0-9A-Za-z.+-]*) echo "[gpu_install] bad release '$RELEASE'"; exit 2 ;; esac
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
# their manifest.json files have the same name). keep_parts DIR FOLDER...
keep_parts() {
  local dir="$1" staged; shift
  mkdir -p "$dir"
  for staged in "$@"; do
    [ -d "$staged" ] || continue
    cp -p "$staged"* "$dir"/
    say "kept $(cd "$staged" && ls *.part* 2>/dev/null | tr '\n' ' ')-> $dir"
  done
  [ -f "$dir/manifest.json" ] || { say "no manifest.json in $dir"; exit 2; }
}
parts_state() {  # DIR: "<have>/<all>" and the missing part names
  "$PY" - "$1" <<'PYCODE'
import json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
have = [p["name"] for p in m["parts"] if os.path.isfile(os.path.join(d, p["name"]))]
print(f"{len(have)}/{len(m['parts'])}", " ".join(p["name"] for p in m["parts"] if p["name"] not in have))
PYCODE
}
stash_report() {  # DIR
  local count missing_parts
  read -r count missing_parts <<<"$(parts_state "$1")"
  say "$1 holds $count parts; missing: ${missing_parts:-none} ($(df -h "$1" | awk 'NR==2 {print $4}') free)"
}
manifest_field() {  # DIR KEY: a field of manifest.json's "joined"
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["joined"][sys.argv[2]])' "$1/manifest.json" "$2"
}

# Steps 1-3: every part of DIR present and intact, joined in manifest order, the whole checked,
# unpacked into UNPACKED. verify_unpack DIR UNPACKED
verify_unpack() {
  local dir="$1" unpacked="$2" count missing name sha joined
  read -r count missing <<<"$(parts_state "$dir")"
  if [ -n "${missing:-}" ]; then
    say "missing parts in $dir ($count present): $missing"
    say "(a machine left idle for 30 s is given back and /tmp starts empty: send the parts again, back to back)"
    exit 2
  fi
  (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || { say "a part is corrupt (sha256 mismatch)"; exit 3; }
  say "parts verified ($(cd "$dir" && wc -l < SHA256SUMS) parts)"
  name="$(manifest_field "$dir" name)"
  sha="$(manifest_field "$dir" sha256)"
  joined="$SC_ROOT/$name"
  "$PY" - "$dir" "$joined" <<'PYCODE'
import json, os, shutil, sys
d, out = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(d, "manifest.json")))
with open(out, "wb") as dst:
    for p in m["parts"]:
        with open(os.path.join(d, p["name"]), "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 22)
PYCODE
  echo "$sha  $joined" | sha256sum --quiet -c - || { say "joined bundle sha256 mismatch"; exit 3; }
  say "joined $name ($(du -m "$joined" | cut -f1) MiB), sha256 ok"
  # xz's threads when present, Python's lzma otherwise
  rm -rf "$unpacked" && mkdir -p "$unpacked"
  if command -v xz >/dev/null 2>&1; then
    xz -dc -T0 "$joined" | tar -x -C "$unpacked"
  else
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$joined" "$unpacked"
  fi
  rm -f "$joined"
}

pip_target() {  # TARGET WHEEL...: a fresh --target folder
  local target="$1"; shift
  rm -rf "$target"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$target" "$@"
}

# spec_compat from this repository: src/ on PYTHONPATH, plus a dist-info in TARGET that carries
# its entry points (vllm.general_plugins), generated from pyproject.toml. write_dist_info TARGET
write_dist_info() {
  "$PY" - "$REPO" "$1" <<'PYCODE'
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
print(f"[gpu_install] spec_compat {version}: {repo / 'src'} (entry points: {', '.join(groups) or 'none'}) -> {site}")
PYCODE
}

write_env() {  # FILE SITE PYTHONPATH [EXTRA LINE...]
  local file="$1" site="$2" path="$3"; shift 3
  {
    echo "export SITE=\"$site\""
    echo "export SITE_SPEC_04=\"$SITE_SPEC_04\""
    echo "export SITE_SPEC_03=\"$SITE_SPEC_03\""
    echo "export PYTHONPATH=\"$path\${PYTHONPATH:+:\$PYTHONPATH}\""
    echo "export SPEC_COMPAT_SPECULATORS=\"0.4.0.1=$SITE_SPEC_04,0.3.0=$SITE_SPEC_03\""
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn"
    echo "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"
    local line
    for line in "$@"; do echo "$line"; done
  } > "$file"
}

# Requirements of everything the run sees in the given folders (the first folder of a name wins,
# as on sys.path), checked against what this interpreter then sees (non-fatal: optional CUDA
# kernel packages are left out on purpose). check_requirements FOLDER...
check_requirements() {
  local path
  path="$(IFS=:; echo "$*")"
  PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$@" <<'PYCODE' || true
import importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
optional = {"flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cudnn-frontend", "fastsafetensors",
            "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels", "opentelemetry-sdk",
            "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai",
            "torchcodec", "pynvvideocodec", "nvtx"}
unmet, seen = [], set()
for dist in md.distributions(path=sys.argv[1:]):
    name = canonicalize_name(dist.metadata["Name"])
    if name in seen:  # shadowed by an earlier folder
        continue
    seen.add(name)
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
}

if [ -n "$RELEASE" ]; then
  # Another vLLM release on top of the 0.22.1 install of this warm session.
  RELEASE_DIR="${1:-${SC_RELEASE_DIR:-/tmp/sc_bundle_$RELEASE}}"
  SITE_R="$SC_ROOT/site-$RELEASE"
  ENV_R="$SC_ROOT/env-$RELEASE.sh"
  MARKER_R="$SC_ROOT/.installed-$RELEASE"
  # r<VERSION>/ (one part) or r<VERSION>a/, r<VERSION>b/, ... (never r<VERSION>.x/ of another release)
  keep_parts "$RELEASE_DIR" "$REPO/build/gpu_parts/r$RELEASE/" "$REPO/build/gpu_parts/r$RELEASE"[a-z]/
  if [ "$STASH_ONLY" = 1 ]; then stash_report "$RELEASE_DIR"; exit 0; fi
  if [ ! -f "$MARKER" ] || [ ! -d "$SITE" ]; then
    say "the 0.22.1 bundle is not installed in $SC_ROOT: install it first (build/gpu_parts/p*/, tools/GPU.md)"
    say "(a machine left idle for 30 s is given back and /tmp starts empty: send the parts again, back to back)"
    exit 2
  fi
  base_sha="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("base", {}).get("joined_sha256") or "")' \
    "$RELEASE_DIR/manifest.json")"
  if [ -n "$base_sha" ] && [ "$base_sha" != "$(cat "$MARKER")" ]; then
    say "warning: vLLM $RELEASE's bundle was checked against base bundle ${base_sha:0:16}…, $SC_ROOT has $(cut -c1-16 "$MARKER")…"
  fi
  JOINED_SHA="$(manifest_field "$RELEASE_DIR" sha256)"
  mkdir -p "$SC_ROOT"
  if [ -f "$MARKER_R" ] && [ "$(cat "$MARKER_R")" = "$JOINED_SHA" ] && [ -d "$SITE_R" ]; then
    say "vLLM $RELEASE bundle $JOINED_SHA already installed in $SITE_R"
  else
    UNPACKED="$SC_ROOT/unpacked-$RELEASE"
    verify_unpack "$RELEASE_DIR" "$UNPACKED"
    say "unpacked: $(ls "$UNPACKED"/wheels | xargs -n1 basename | tr '\n' ' ')"
    pip_target "$SITE_R" "$UNPACKED"/wheels/*.whl
    rm -rf "$UNPACKED"
    echo "$JOINED_SHA" > "$MARKER_R"
    say "installed into $SITE_R"
  fi
  write_dist_info "$SITE_R"
  write_env "$ENV_R" "$SITE_R" "$SITE_R:$SITE:$REPO/src" \
    "export SC_SITE_BASE=\"$SITE\"" "export SC_VLLM_RELEASE=\"$RELEASE\""
  check_requirements "$SITE_R" "$SITE"
  PYTHONPATH="$SITE_R:$SITE:$REPO/src" "$PY" - "$RELEASE" <<'PYCODE' || { say "vLLM's metadata does not say $RELEASE"; exit 4; }
import importlib.metadata as md, sys
have = md.version("vllm")
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("spec_compat")]
print(f"[gpu_install] importlib.metadata: vllm {have}, compressed-tensors {md.version('compressed-tensors')}; "
      f"vllm.general_plugins: {', '.join(eps) or 'no spec_compat entry point'}")
sys.exit(have != sys.argv[1] or not eps)
PYCODE
  say "done in $((SECONDS - started)) s; exports (also in $ENV_R):"
  sed 's/^/    /' "$ENV_R"
  exit 0
fi

# The 0.22.1 bundle: only build/gpu_parts/p*/ (the release folders r*/ are not its parts).
keep_parts "$BUNDLE_DIR" "$REPO"/build/gpu_parts/p*/
if [ "$STASH_ONLY" = 1 ]; then stash_report "$BUNDLE_DIR"; exit 0; fi
JOINED_SHA="$(manifest_field "$BUNDLE_DIR" sha256)"
mkdir -p "$SC_ROOT"

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$JOINED_SHA" ]; then
  say "bundle $JOINED_SHA already installed in $SC_ROOT"
else
  # 1.-3. every part present and intact, joined, checked, unpacked
  UNPACKED="$SC_ROOT/unpacked"
  verify_unpack "$BUNDLE_DIR" "$UNPACKED"
  say "unpacked: $(ls "$UNPACKED"/wheels | wc -l) wheels + speculators $(ls -d "$UNPACKED"/spec-* | xargs -n1 basename | tr '\n' ' ')"

  # 4. install
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

# 5. spec_compat: src/ on PYTHONPATH, its dist-info in $SITE
write_dist_info "$SITE"
write_env "$ENV_FILE" "$SITE" "$SITE:$REPO/src"

# 6. requirements of everything in $SITE
check_requirements "$SITE"

say "done in $((SECONDS - started)) s; exports (also in $ENV_FILE):"
sed 's/^/    /' "$ENV_FILE"
