"""benchmarks/gpu.py: the order its extract paths run in (no engine: run_extract replaced)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_extract_variants_run_set_by_set_and_a_short_budget_keeps_whole_pairs(tmp_path: Path) -> None:
    """Several extract paths run the first set for each, then the next set for each: when the budget
    runs out, the sets done have both sides of the A/B (run X lost its A/B by running one path's sets
    first). A set is skipped once the budget left is under the longest set run so far."""
    import argparse

    from gpu import Bench

    bench = object.__new__(Bench)
    ran: list[tuple[str, str]] = []
    budget = {"left": 100.0}
    bench.args = argparse.Namespace(variant_env={"b": {"K": "1"}}, variant_args={}, extract_args="", path_timeout_s=50)
    bench.variants, bench.env, bench.logs, bench.priors = {"b": "extract"}, {}, tmp_path, {"extract": 10.0}
    bench.remaining = lambda: budget["left"]  # type: ignore[method-assign]
    bench.extract_root = lambda base: tmp_path  # type: ignore[method-assign]
    bench.measure_disk = lambda root: {"gb_per_s": {}}  # type: ignore[method-assign]

    def run_extract(spec: Any, entry: Any, log: Path, timeout: float, root: Path, args: str, env: Any) -> Any:
        ran.append((log.stem.split("_")[-2], entry["name"]))
        budget["left"] -= 30.0
        return {"status": "ok", "wall_s": 30.0, "env": env, "tokens_per_s": [1.0], "tokens_per_s_median": 1.0}

    bench.run_extract = run_extract  # type: ignore[method-assign]
    spec = {"sets": [{"name": "s1"}, {"name": "s2"}, {"name": "s3"}]}
    records = bench.run_extract_group("m", ["extract", "b"], spec, 0)

    # 100 s: 70 left after extract s1, 40 after b s1, 10 after extract s2: under the 30 s a set took, so b s2 waits
    assert ran == [("extract", "s1"), ("b", "s1"), ("extract", "s2")]
    assert records["b"]["sets"]["s1"]["env"] == {"K": "1"} and records["extract"]["sets"]["s1"]["env"] == {}
    assert records["b"]["sets"]["s2"]["status"] == "not-run" and records["b"]["status"] == "partial"
    assert records["extract"]["sets"]["s3"]["status"] == "not-run" and records["extract"]["wall_s"] == 60.0
