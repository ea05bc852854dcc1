"""Compare the preflight of two sets of matrix records (issue 30: behaviour unchanged by a refactor).

    python3 tools/preflight_compare.py docs/matrix /tmp/after     # records of the same labels, two commits

For every label in both folders and every speculators version in both records: the verdict, the
active adapters and the failed checks must be the same, and so must the environment the two
preflights saw (the records' resolved package versions, spec-compat's own aside): a preflight of
another transformers or torch proves nothing about the refactor. Prints one line per difference
and a summary; exits 1 if anything differs (a label or version in one folder only is listed, not
failed). ``tools/preflight_before_after.sh`` makes the two folders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def preflights(folder: Path) -> dict[str, dict[str, Any]]:
    records = {}
    for path in sorted(folder.glob("vllm-*.json")):
        record = json.loads(path.read_text())
        records[record.get("label", path.stem)] = record
    return records


def facts(preflight: dict[str, Any]) -> dict[str, Any]:
    failed = sorted(json.dumps(check, sort_keys=True) for check in preflight.get("failed_checks", []))
    active = sorted(preflight.get("active_adapters", []))
    return {"verdict": preflight.get("verdict"), "active": active, "failed": failed}


def environment(record: dict[str, Any]) -> dict[str, Any]:
    """The package versions a record's preflights ran with, less spec-compat (the thing compared); a
    package not installed counts as absent (newer records also list the names they did not find)."""
    versions = record.get("versions", {}).items()
    return {name: version for name, version in versions if name != "spec-compat" and version is not None}


def compare(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> tuple[list[str], int]:
    differences: list[str] = []
    compared = 0
    for label in sorted(set(before) & set(after)):
        if environment(before[label]) != environment(after[label]):
            differences.append(
                f"{label}: environments differ: {environment(before[label])} -> {environment(after[label])}"
            )
            continue
        old, new = before[label].get("preflight", {}), after[label].get("preflight", {})
        for version in sorted(set(old) & set(new)):
            compared += 1
            a, b = facts(old[version]), facts(new[version])
            for key in a:
                if a[key] != b[key]:
                    if key == "active":
                        gone, added = sorted(set(a[key]) - set(b[key])), sorted(set(b[key]) - set(a[key]))
                        differences.append(f"{label} speculators {version}: adapters gone {gone}, new {added}")
                    else:
                        differences.append(f"{label} speculators {version}: {key} {a[key]} -> {b[key]}")
    return differences, compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = preflights(args.before), preflights(args.after)
    differences, compared = compare(before, after)
    for line in differences:
        print(line)
    only = sorted(set(before) ^ set(after))
    print(f"{compared} preflights compared, {len(differences)} differences; in one folder only: {len(only)} labels")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
