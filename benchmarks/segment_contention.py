"""How much a shared-memory segment made on a background thread slows the GPU steps beside it, and why.

Run AA (docs/benchmarks.md, one H100): every time the worker's segment pool made a segment (0.5 GB:
fallocate, populate, cudaHostRegister) while the engine's steps ran, the step beside it took 0.2-0.3 s
longer (batch 1 and one batch of the tail in every extract run), about the segment's own making time:
the steps seem to wait for it rather than run beside it. This separates the suspects, torch only (runs
on the GPU image without the bundle):

- a step: ``--kernels`` small launches (matmul + add on ``--rows`` x ``--hidden`` bf16, eager-forward-like:
  launch-bound), then, with ``--copies``, each of ``--layers`` rows copied to a pinned segment
  (non_blocking, as the streamed reply does), then a synchronize (as sample_tokens does);
- while steps run, once, on a background thread, one of: ``populate`` (fallocate + mmap MAP_POPULATE, no
  pinning), ``register`` (the same + one cudaHostRegister of the whole segment: what transfer.Segment
  does), ``register_chunks`` (registered in ``--chunk-mib`` pieces, the GIL and the driver free between
  pieces), ``idle`` (nothing: the baseline);
- per variant: seconds the making took, and how much longer the steps during it took than the median
  step of the same run (``slowdown_s``).

``--straddle``: whether a non_blocking device-to-host copy into host memory that spans two separately
registered pieces is still asynchronous (returns before a long kernel queued ahead of it ends) and
correct. Chunked registration is only a fix if it is.

    python benchmarks/segment_contention.py --out segment_contention.json     # CUDA when present, else CPU
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from spec_compat.adapters import transfer

VARIANTS = ("idle", "populate", "register", "register_chunks")


def make_segment(directory: str, size: int, variant: str, chunk: int) -> tuple[Any, list[int]]:
    """The segment's mapping and the addresses registered (to unregister), made as ``variant`` says."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="segment-contention-")
    os.posix_fallocate(fd, 0, size)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | transfer.MAP_POPULATE)
    os.close(fd)
    os.unlink(path)
    registered: list[int] = []
    if variant.startswith("register") and torch.cuda.is_available():
        host = torch.frombuffer(mapping, dtype=torch.uint8)
        runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        step = size if variant == "register" else chunk
        for start in range(0, size, step):
            address = host.data_ptr() + start
            code = runtime.cudaHostRegister(address, min(step, size - start), 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister: {code}")
            registered.append(address)
        del host
    return mapping, registered


def release(mapping: Any, registered: list[int]) -> None:
    if registered:
        runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for address in registered:
            runtime.cudaHostUnregister(address)
    mapping.close()


def run_variant(args: argparse.Namespace, device: torch.device, variant: str, target: torch.Tensor) -> dict[str, Any]:
    """``--steps`` steps; the segment is made on a background thread from step ``--start-at``."""
    weight = torch.randn(args.hidden, args.hidden, device=device, dtype=torch.bfloat16) / args.hidden**0.5
    rows = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16)
    made: dict[str, Any] = {}

    def make() -> None:
        started = time.perf_counter()
        made["segment"] = make_segment(args.directory, args.segment_mib << 20, variant, args.chunk_mib << 20)
        made["making"] = (started, time.perf_counter())

    side = torch.cuda.Stream(device=device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    maker: threading.Thread | None = None
    steps: list[tuple[float, float]] = []
    layer_bytes = args.rows * args.hidden * 2
    index = 0
    while index < args.steps or (maker is not None and maker.is_alive()):  # every step beside the making
        if index == args.start_at and variant != "idle":
            maker = threading.Thread(target=make, name="segment-maker")
            maker.start()
        started = time.perf_counter()
        hidden = rows
        for _ in range(args.kernels):
            hidden = torch.addmm(rows, hidden, weight)
        if args.copies:
            for layer in range(args.layers):
                view = target[layer * layer_bytes : (layer + 1) * layer_bytes].view(torch.bfloat16)
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        view.view(args.rows, args.hidden).copy_(hidden, non_blocking=True)
                    hidden.record_stream(side)  # not reused by the next step's kernels before the copy is done
                else:
                    view.view(args.rows, args.hidden).copy_(hidden)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append((started, time.perf_counter()))
        index += 1
    if maker is not None:
        maker.join()
        release(*made["segment"])
    durations = [end - start for start, end in steps]
    baseline = statistics.median(durations)
    record: dict[str, Any] = {"step_s_median": baseline, "steps_s": durations}
    if "making" in made:
        begin, end = made["making"]
        during = [d for (s, e), d in zip(steps, durations, strict=True) if e > begin and s < end]
        record.update(
            making_s=end - begin,
            steps_during=len(during),
            slowdown_s=sum(during) - baseline * len(during),
        )
    return record


def straddle_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A copy into host memory spanning two registered pieces: asynchronous and correct?"""
    chunk = args.chunk_mib << 20
    mapping, registered = make_segment(args.directory, 2 * chunk, "register_chunks", chunk)
    try:
        host = torch.frombuffer(mapping, dtype=torch.uint8)
        source = torch.randint(0, 255, (chunk,), device=device, dtype=torch.uint8)
        window = host[chunk // 2 : chunk // 2 + chunk]  # half in each piece
        inside = host[: chunk // 2]  # within the first piece
        busy = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        results: dict[str, Any] = {"pieces": len(registered)}
        for name, destination in (("within_one_piece", inside), ("across_two_pieces", window)):
            for _ in range(3):
                busy @ busy  # queued ahead of the copy: an asynchronous copy returns before it ends
            started = time.perf_counter()
            destination.copy_(source[: destination.numel()], non_blocking=True)
            enqueue_s = time.perf_counter() - started
            torch.cuda.synchronize(device)
            total_s = time.perf_counter() - started
            results[name] = {
                "enqueue_s": enqueue_s,
                "until_done_s": total_s,
                "asynchronous": enqueue_s < total_s / 4,
                "equal": bool(torch.equal(destination, source[: destination.numel()].cpu())),
            }
        del host, window, inside, destination  # no view may outlive the mapping
        return results
    finally:
        release(mapping, registered)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--segment-mib", type=int, default=560, help="run AA's segments: 0.49 GB + 1/8")
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8192, help="tokens per step")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kernels", type=int, default=200, help="launches per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--start-at", type=int, default=10)
    parser.add_argument("--copies", type=int, default=1, help="1: each step's rows copied to a pinned segment")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--directory", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    variants = [v for v in args.variants.split(",") if cuda or not v.startswith("register")]
    target_mapping, target_registered = make_segment(
        args.directory, args.layers * args.rows * args.hidden * 2, "register" if cuda else "populate", 0
    )
    target = torch.frombuffer(target_mapping, dtype=torch.uint8)
    run_variant(args, device, "idle", target)  # warm-up
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "args": vars(args),
        "variants": {},
    }
    for rep in range(args.reps):
        for variant in variants:
            result = run_variant(args, device, variant, target)
            record["variants"].setdefault(variant, []).append(result)
            extra = ""
            if "making_s" in result:
                extra = f", making {result['making_s']:.3f} s, slowdown {result['slowdown_s']:.3f} s over"
                extra += f" {result['steps_during']} steps"
            print(f"rep {rep} {variant:16} step {result['step_s_median'] * 1e3:.1f} ms{extra}", flush=True)
    if cuda:
        record["straddle"] = straddle_check(args, device)
        print("straddle", json.dumps(record["straddle"]), flush=True)
    del target
    release(target_mapping, target_registered)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
