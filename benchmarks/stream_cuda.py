"""The streamed reply (adapter captured-states-streamed) against speculators' own reply + ``pack``, on one
device, without vLLM: the check that runs where the GPU image has torch but no bundle is installed.

One batch shaped like run Z's middle batches (32 prompts of chat lengths, ~29k tokens, engine steps of
8,192 tokens, 4 layers of a 2048-wide bf16 model; each step a matmul load standing in for the forward):
- ``pack``: speculators 0.4.x's ``_get_captured_states`` walk on the device (a concatenation per layer, a
  clone per chunk, a concatenation per request) then ``transfer.pack`` (one device-to-host copy);
- ``stream``: ``StatesStreamer.step`` after each step (copies on a side stream beside the next step's
  load), ``finish`` after the last.
Both replies are opened as the driver opens them and compared bit for bit; the seconds from the last
step's end to the reply, and the batch's wall time, are medians of ``--reps`` batches after a warm-up.

    python benchmarks/stream_cuda.py --out results.json              # CUDA when present, else CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from spec_compat.adapters import stream, transfer

Metadata = list[list[tuple[str, int]]]


def schedule(lengths: list[int], budget: int, prefix: str) -> Metadata:
    """Per step, (request, rows) in the order of the step's rows, the way vLLM's persistent batch orders them:
    a request that finished its prompt leaves its slot, the next new request takes the lowest free slot."""
    slots: list[str | None] = []
    left = {f"{prefix}_{i}": n for i, n in enumerate(lengths)}
    waiting = list(left)
    steps: Metadata = []
    while any(left.values()):
        slots = [s if s is not None and left[s] else None for s in slots]
        room = budget
        step: dict[str, int] = {}
        for req in [s for s in slots if s is not None]:
            take = min(left[req], room)
            if take:
                step[req] = take
                room -= take
        while room and waiting:
            req = waiting.pop(0)
            slot = slots.index(None) if None in slots else len(slots)
            if slot == len(slots):
                slots.append(req)
            else:
                slots[slot] = req
            step[req] = min(left[req], room)
            room -= step[req]
        order = {req: i for i, req in enumerate(slots) if req is not None}
        ordered = sorted(step.items(), key=lambda item: order[item[0]])
        for req, take in ordered:
            left[req] -= take
        steps.append(ordered)
    return steps


def speculators_reply(steps: list[list[torch.Tensor]], metadata: Metadata) -> dict[str, list[torch.Tensor]]:
    """speculators 0.4.x's _get_captured_states: concatenate each layer's steps, walk the metadata (one
    clone per chunk), concatenate each request's chunks (also tests/unit/test_stream.py's reference)."""
    layers = [torch.cat([step[i] for step in steps]) for i in range(len(steps[0]))]
    chunks: defaultdict[str, list[list[torch.Tensor]]] = defaultdict(lambda: [[] for _ in layers])
    position = 0
    for step in metadata:
        for req_id, count in step:
            for i, layer in enumerate(layers):
                chunks[req_id][i].append(layer[position : position + count].clone())
            position += count
    return {req_id: [torch.cat(c) for c in per_layer] for req_id, per_layer in chunks.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_batch(
    mode: str, streamer: stream.StatesStreamer, pool: transfer.SegmentPool, lengths: list[int], args: Any, call: int
) -> tuple[Any, list[list[torch.Tensor]], Metadata, float, float]:
    """Run one batch; (reply, step tensors, metadata, seconds after the last step, batch seconds)."""
    device = torch.device(args.device)
    metadata = schedule(lengths, args.step_tokens, f"req_{call}")
    prompts = dict.fromkeys([req for step in metadata for req, _ in step], 0)
    for step in metadata:
        for req, count in step:
            prompts[req] += count
    load = torch.randn(args.load_size, args.load_size, device=device, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(call)
    steps: list[list[torch.Tensor]] = []
    sync(device)
    started = time.perf_counter()
    for index, step in enumerate(metadata):
        rows = sum(count for _, count in step)
        for _ in range(args.load_matmuls):  # the forward's stand-in
            load = (load @ load).tanh()
        tensors = [
            torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(args.layers)
        ]
        steps.append(tensors)
        if mode == "stream":
            streamer.step(tensors, index == 0, step, prompts.get)
    sync(device)  # vLLM's sample_tokens ends each step on the host
    ended = time.perf_counter()
    if mode == "stream":
        reply: Any = streamer.finish(metadata)
    else:
        reply = transfer.pack(speculators_reply(steps, metadata), pool)
    done = time.perf_counter()
    return reply, steps, metadata, done - ended, done - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--load-size", type=int, default=8192, help="matmul side of the forward's stand-in")
    parser.add_argument("--load-matmuls", type=int, default=12)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    lengths = [max(32, min(4000, int(rng.lognormvariate(6.4, 0.9)))) for _ in range(args.prompts)]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix=transfer.DIR_PREFIX, dir=base)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    out.update(tokens=sum(lengths), args=vars(args) | {"out": str(args.out)})
    if args.device == "cuda":
        os.environ[stream.CUDA_ENV] = "1"
    figures: dict[str, dict[str, list[float]]] = {
        m: {"after_last_step_s": [], "batch_s": []} for m in ("pack", "stream")
    }
    equal: list[bool] = []
    mappings = transfer.DriverMappings(directory)
    pool = transfer.SegmentPool(directory, "bench")
    streamer = stream.StatesStreamer(pool)
    streamer.recent_rows.append(sum(lengths))
    for call in range(args.reps + 1):
        for mode in ("pack", "stream") if call % 2 else ("stream", "pack"):
            reply, steps, metadata, after, batch = one_batch(mode, streamer, pool, lengths, args, call)
            if not isinstance(reply, transfer.SharedStates):
                raise SystemExit(f"{mode}: no shared reply ({streamer.last_declined})")
            if mode == "stream":
                want = {k: [t.cpu() for t in v] for k, v in speculators_reply(steps, metadata).items()}
                got = mappings.open(reply)
                equal.append(
                    list(got) == list(want)
                    and all(torch.equal(a, b) for k in want for a, b in zip(got[k], want[k], strict=True))
                )
                del got
            if call:  # the first is the warm-up
                figures[mode]["after_last_step_s"].append(after)
                figures[mode]["batch_s"].append(batch)
            del reply, steps
    out["bitwise_equal"] = all(equal) and bool(equal)
    out["steps"] = len(schedule(lengths, args.step_tokens, "x"))
    out["median"] = {m: {k: statistics.median(v) for k, v in f.items()} for m, f in figures.items()}
    out["runs"] = figures
    out["streamed"], out["declined"] = streamer.streamed, streamer.declined
    pool.close()
    mappings.close()
    transfer.remove_directory(directory)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
