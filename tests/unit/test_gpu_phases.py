"""benchmarks/gpu.py: an extract run's seconds split into fill, middle and end (extract_phases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_phases_split_the_fill_the_full_size_middle_and_the_tapered_end() -> None:
    from gpu import extract_phases

    # batch 0 (warm-up) 0.5 s, batch 1 slow (0.4 s: the pipeline fills), then 4 full batches of 30k at 0.2 s
    # each (150k tokens/s), then a tail of two 7.5k batches taking 0.3 s and a 0.1 s drain
    timeline = [[0.49, 0.5, 30000], [0.89, 0.9, 30000]]
    timeline += [[0.9 + 0.2 * i - 0.01, 0.9 + 0.2 * i, 30000] for i in range(1, 5)]
    timeline += [[1.85, 1.85, 7500], [2.0, 2.0, 7500]]
    stats = {"timeline": timeline, "pending_batches": 2, "extract_s": 2.1, "first_batch_s": 0.5}

    phases = extract_phases(stats)

    assert phases is not None
    assert phases["fill_s"] == pytest.approx(0.9) and phases["fill_tokens"] == 60000
    assert phases["middle_batches"] == 4 and phases["middle_tokens_per_s"] == pytest.approx(150000)
    assert phases["end_s"] == pytest.approx(0.4) and phases["end_tokens"] == 15000
    # 1.6 s after the first batch for 165k tokens, of which 1.1 s at the middle's pace: 0.5 s paid once
    assert phases["fixed_s"] == pytest.approx(0.5)


def test_no_phases_without_a_full_size_batch_after_the_fill() -> None:
    from gpu import extract_phases

    stats = {"timeline": [[0.5, 0.5, 30000], [0.9, 0.9, 30000], [1.0, 1.0, 5000]], "pending_batches": 2}
    assert extract_phases({**stats, "extract_s": 1.1, "first_batch_s": 0.5}) is None
    assert extract_phases({"timeline": [], "pending_batches": 2, "extract_s": 1.0, "first_batch_s": 0.5}) is None


def test_the_second_batchs_largest_timings_are_printed() -> None:
    from gpu import second_batch_text

    per_batch = [{"rpc:execute_model": 0.1}, {"rpc:execute_model": 0.2, "transfer:worker-new-segment": 0.15}]
    text = second_batch_text({"batch_timings": per_batch})
    assert text == "; second batch: rpc:execute_model 0.200 s, transfer:worker-new-segment 0.150 s"
    assert second_batch_text({"batch_timings": per_batch[:1]}) == "" == second_batch_text({})


def test_the_slowest_later_batch_and_the_segments_are_printed() -> None:
    from gpu import segments_text, slowest_later_batch_text

    # 10k-token batches at 100k tokens/s (0.1 s each), batch 3 0.3 s: 0.2 s beyond its tokens' time
    timeline = [[0.5, 0.5, 10000], [0.8, 0.8, 10000], [0.9, 0.9, 10000], [1.2, 1.2, 10000], [1.3, 1.3, 10000]]
    per_batch = [{}, {}, {"rpc:execute_model": 0.05}, {"rpc:execute_model": 0.25, "rpc:sample_tokens": 0.04}, {}]
    text = slowest_later_batch_text({"timeline": timeline, "batch_timings": per_batch}, 100000.0)
    assert text == "; slowest later batch 3 (+0.200 s): rpc:execute_model 0.250 s, rpc:sample_tokens 0.040 s"
    assert slowest_later_batch_text({"timeline": timeline[:2], "batch_timings": per_batch[:2]}, 1.0) == ""
    transfer = {"segments_made": 3, "segments_live_max": 4}
    assert segments_text({"transfer": transfer}) == "; segments 3 used, 4 at most"
    assert segments_text({}) == ""
