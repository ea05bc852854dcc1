#!/usr/bin/env bash
# A refactor that should change nothing (issue 30): the matrix preflight of commit BEFORE and of this
# checkout on each RELEASE, both in the same venv one after the other (BEFORE from a temporary git
# worktree), then tools/preflight_compare.py over the two folders.
#
#   bash tools/preflight_before_after.sh BEFORE OUT RELEASE [RELEASE ...]
#   e.g. bash tools/preflight_before_after.sh 0f07f98 docs/matrix/issue30_preflight 0.11.2 0.12.0
#
# Records go to OUT/before and OUT/after (one docs/matrix-style record per release, 3 speculators
# versions each); the venvs are tools/matrix.py's (one per torch pin, under ~/.cache/spec_compat/matrix).
# BEFORE runs first so that the venv's editable spec_compat points at this checkout afterwards.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash tools/preflight_before_after.sh BEFORE OUT RELEASE [RELEASE ...]" >&2
  exit 2
fi
before="$1"
out="$(realpath -m "$2")"
shift 2
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tree="$(mktemp -d)/before"
git -C "$repo" worktree add -q --detach "$tree" "$before"
trap 'git -C "$repo" worktree remove --force "$tree"' EXIT
for release in "$@"; do
  (cd "$tree" && python3 tools/matrix.py cell --vllm "$release" --kind preflight --out "$out/before")
  python3 "$repo/tools/matrix.py" cell --vllm "$release" --kind preflight --out "$out/after"
done
python3 "$repo/tools/preflight_compare.py" "$out/before" "$out/after"
