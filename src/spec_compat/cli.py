"""The ``spec-compat`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# extract's --format choices, without importing the extract package (torch-free, but not needed by doctor / run)
EXTRACT_FORMATS = ("speculators-v1", "speculators-hs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spec-compat", description="speculators' hidden-state generator on any vLLM")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check this environment without loading a model")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--explain",
        action="store_true",
        help="under each adapter that applies: what it patches, why, the vLLM change behind it, when it can be deleted",
    )
    extract = commands.add_parser("extract", help="dataset -> hidden-state training files (resumable, shardable)")
    extract.add_argument("--model", required=True, help="model directory (or hub id, where reachable)")
    extract.add_argument("--input", required=True, type=Path, help="JSONL: one sample per line")
    extract.add_argument("--output", required=True, type=Path, help="output directory")
    extract.add_argument("--layer-ids", required=True, help="comma-separated decoder layer ids, e.g. 2,15,28")
    extract.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    extract.add_argument("--max-model-len", type=int, default=2048)
    extract.add_argument(
        "--batch-size", type=int, default=None, help="samples per generate() call (default: the engine's max_num_seqs)"
    )
    extract.add_argument("--batch-tokens", type=int, default=32768, help="at most this many tokens per call")
    extract.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (vLLM's max_num_batched_tokens; speculators 0.4.x). Default: speculators' "
        "own, max(8192, --max-model-len)",
    )
    extract.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the engine's running slots (vLLM's max_num_seqs), hence the most samples in one call. Default: "
        "speculators' own, 32",
    )
    extract.add_argument(
        "--writer-threads", type=int, default=None, help="threads writing files (default: half the cores, <= 8)"
    )
    extract.add_argument(
        "--writer",
        choices=["process", "threads"],
        default=None,
        help="where the files are written: a process of its own that maps the states from shared memory (the "
        "default: no GIL shared with the engine loop; docs/extract.md), or threads of this process",
    )
    extract.add_argument(
        "--pending-batches", type=int, default=2, help="batches being written while the next runs (memory bound)"
    )
    extract.add_argument("--ids-field", default="input_ids", help="JSONL field holding token ids")
    extract.add_argument(
        "--text-field", default=None, help="JSONL field with text, tokenized with the model's tokenizer"
    )
    extract.add_argument("--shard", default="0/1", help="i/N: take lines whose index %% N == i")
    extract.add_argument("--on-error", choices=["stop", "skip"], default="stop")
    extract.add_argument("--dtype", default=None, help="model dtype (default: speculators' 'auto')")
    extract.add_argument(
        "--save-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "fp8"],
        help="dtype of the saved states (fp8: float8_e4m3fn with a float32 scale per token, as speculators' FP8 "
        "connector writes; its error against bf16 goes into the manifest)",
    )
    extract.add_argument(
        "--format",
        default="speculators-v1",
        choices=list(EXTRACT_FORMATS),
        help="speculators-v1: data_{i}.pt, for speculators 0.3 / 0.4; speculators-hs: a dataset with "
        "hidden_states/hs_{i}.safetensors, for speculators >= 0.5 (docs/extract.md)",
    )
    extract.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    extract.add_argument(
        "--zip-crc32",
        action="store_true",
        help="let torch.save compute each record's zip CRC32 "
        "(off: torch.load never checks it; the manifest's sha256 is the check)",
    )
    extract.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not fsync each file before the manifest lists it (faster on slow disks; a power cut may then "
        "leave listed files incomplete, which a rerun detects by their sha256 and redoes)",
    )
    extract.add_argument(
        "--direct-io",
        action="store_true",
        help="stage each file in /dev/shm and write it with O_DIRECT, skipping the page cache (faster on some "
        "disks, slower on others: benchmarks/extract_writer.py tells; the page cache where O_DIRECT is refused)",
    )
    extract.add_argument(
        "--conversations",
        action="store_true",
        help="the input is chat data (ShareGPT 'conversations' / 'messages'), tokenized and loss-masked by the "
        "installed speculators' own preprocessing (chat template, assistant turns)",
    )
    extract.add_argument("--seed", type=int, default=0, help="speculators' preprocessing seed (--conversations)")
    extract.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="N generators as Ray actors (each --tp GPUs, or CPUs), fed batches from one queue (needs "
        "spec-compat[ray]); without --ray-address on a local Ray",
    )
    extract.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (e.g. auto, or head-ip:6379) (--replicas)"
    )
    extract.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="--replicas: re-runs of a batch after engines died under it (then halves, then the sample is "
        "recorded as failed); starts of a replica that fails to start",
    )
    run_cmd = commands.add_parser(
        "run",
        help="run COMMAND (and every Python process it starts) with spec_compat applied",
        usage="spec-compat run [--dtype D] [--disable IDS] [--worker-log-level L] [--strict] -- COMMAND [ARGS ...]",
    )
    run_cmd.add_argument("--dtype", default=None, help="model dtype (SPEC_COMPAT_DTYPE; default: speculators' 'auto')")
    run_cmd.add_argument("--disable", default="", help="comma-separated adapter ids to leave out (SPEC_COMPAT_DISABLE)")
    run_cmd.add_argument("--worker-log-level", default=None, help="e.g. INFO: speculators' worker log lines, per rank")
    run_cmd.add_argument("--strict", action="store_true", help="fail if anything cannot be made compatible")
    run_cmd.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    args = parser.parse_args(argv)
    if args.command == "run":
        from . import launcher

        disable = [x.strip() for x in args.disable.split(",") if x.strip()]
        problem = launcher.check_options(args.dtype, disable, args.worker_log_level)
        if problem:
            run_cmd.error(problem)
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return launcher.run(command, args.dtype, disable, args.worker_log_level, args.strict)
    if args.command == "doctor":
        from .doctor import run

        return run(as_json=args.json, explain=args.explain)
    if args.command == "extract":
        from .errors import IncompatibleError
        from .extract import (
            ExtractConfig,
            ExtractError,
            WriteFailed,
            default_writer_threads,
            parse_shard,
            taper_divisor,
        )
        from .extract import run as run_extract

        try:
            layer_ids = [int(x) for x in args.layer_ids.split(",") if x.strip()]
        except ValueError:
            extract.error(f"--layer-ids must be comma-separated integers, got {args.layer_ids!r}")
        try:
            shard = parse_shard(args.shard)
        except ValueError as exc:
            extract.error(str(exc))
        positive = (
            "batch_size", "batch_tokens", "writer_threads", "pending_batches", "tp", "max_model_len",
            "max_num_batched_tokens", "max_num_seqs",
        )  # fmt: skip
        for name in (*positive, "replicas"):
            value = getattr(args, name)
            if value is not None and value < 1:
                extract.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.text_field and args.conversations:
            extract.error("--text-field and --conversations exclude each other")
        if args.writer == "process" and args.replicas is not None:
            extract.error("--writer process is for one process; with --replicas each replica writes on its own threads")
        if args.ray_address is not None and args.replicas is None:
            extract.error("--ray-address needs --replicas N")
        if args.max_retries < 0:
            extract.error(f"--max-retries must be >= 0, got {args.max_retries}")
        try:
            taper_divisor()  # SPEC_COMPAT_EXTRACT_TAPER, refused here rather than after the engine loads
        except ValueError as exc:
            extract.error(str(exc))
        # the options stored under the config field's own name, then those renamed or derived
        same_name = (
            "model", "input", "output", "max_model_len", "batch_size", "batch_tokens", "pending_batches",
            "text_field", "ids_field", "on_error", "dtype", "save_dtype", "gpu_memory_utilization", "zip_crc32",
            "conversations", "seed", "format", "max_num_batched_tokens", "max_num_seqs",
        )  # fmt: skip
        config = ExtractConfig(
            **{name: getattr(args, name) for name in same_name},
            layer_ids=layer_ids,
            tensor_parallel_size=args.tp,
            writer_threads=args.writer_threads or default_writer_threads(),
            shard=shard,
            fsync=not args.no_fsync,
            direct_io=args.direct_io,
            # ExtractConfig's default unless given (--replicas: each replica writes on its own threads)
            **({"writer": args.writer} if args.writer else {}),
        )
        try:
            if args.replicas is not None:
                from .extract.distributed import run_distributed

                return run_distributed(config, args.replicas, args.ray_address, args.max_retries)
            return run_extract(config)
        except WriteFailed as exc:  # the samples already listed in the manifest are complete and kept
            print(f"spec-compat extract: error: {exc}; what is done is kept: rerun to finish", file=sys.stderr)
            return 1
        except ExtractError as exc:
            print(f"spec-compat extract: error: {exc}", file=sys.stderr)
            return 2
        except IncompatibleError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"spec-compat extract: error: {first} (spec-compat doctor shows the whole report)", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
