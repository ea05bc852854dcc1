"""Run speculators' own offline pipeline script, unmodified, under ``spec-compat run`` and check what it wrote.

    python tools/speculators_script_check.py --script /path/to/speculators/scripts/data_generation_offline.py \\
        --speculators DIR [--datasets DIR] [--tp 2]

``--script``: the script from a speculators checkout at the tag matching ``--speculators`` (a
``pip install --target`` directory of that speculators release); it is run as it is, never copied
here. ``--datasets``: a directory holding the ``datasets`` package (speculators' preprocessing needs
it; e.g. ``pip install --no-deps --target DIR datasets pyarrow multiprocess xxhash pandas
python-dateutil tzdata six``), if the venv lacks it. On CPU and offline: the tiny dense test model
(with a chat template added, tokens masked by ``{% generation %}``) and generated ShareGPT
conversations. Checks every ``data_{i}.pt``: hidden states against HF transformers (float32),
``input_ids`` / ``loss_mask`` against speculators' own ``load_and_preprocess_dataset`` with the same
seed, ``sample_lengths.json`` where the release writes it; and a clean exit (no traceback). Prints one
JSON line of figures; exit code 0 when everything holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LAYER_IDS = [0, 2, 3]
SEQ_LENGTH = 256
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|bos|>assistant: {% generation %}{{ message['content'] }}<|eos|>"
    "{% endgeneration %}{% else %}<|bos|>{{ message['role'] }}: {{ message['content'] }}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)
WORDS = ["the", "a", "model", "layer", "state", "hidden", "token", "vllm", "draft", "eagle", "speculative"]
WORDS += ["train", "data", "batch", "worker", "engine"]


def _model(work: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import build_model

    base = build_model("dense", work / "model_base")
    model = work / "model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(base, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return model


def _conversations(path: Path, count: int, seed: int = 3) -> Path:
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with path.open("w") as handle:
        for i in range(count):
            turns: list[dict[str, str]] = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"from": "human", "value": sentence(rng.randint(2, 8))})
                turns.append({"from": "gpt", "value": sentence(rng.randint(3, 12))})
            handle.write(json.dumps({"id": str(i), "conversations": turns}) + "\n")
    return path


def _env(args: argparse.Namespace) -> dict[str, str]:
    paths = [str(args.speculators), *([str(args.datasets)] if args.datasets else [])]
    return dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(paths),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(args.tp)),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )


def check(out: Path, model: Path, data: Path, cache: Path) -> dict[str, Any]:
    """Run inside ``spec-compat run`` (speculators' preprocessing imports speculators)."""
    import torch
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import hf_layer_outputs

    dataset, _ = load_and_preprocess_dataset(
        target_model_path=str(model), train_data_path=str(data), seq_length=SEQ_LENGTH, build_dataset_num_proc=1,
        seed=0, token_freq_path=str(out.parent / "token_freq_check.pt"), cache_dir=str(cache),
    )  # fmt: skip
    files = sorted(out.glob("data_*.pt"), key=lambda p: int(p.stem[len("data_") :]))
    samples = [torch.load(p, weights_only=True) for p in files]
    ids = [s["input_ids"].tolist() for s in samples]
    reference = hf_layer_outputs(model, ids, LAYER_IDS)
    worst = 0.0
    for sample, want in zip(samples, reference, strict=True):
        for got, ref in zip(sample["hidden_states"], want, strict=True):
            worst = max(worst, float((got.float() - ref).abs().max()) / max(1.0, float(ref.abs().max())))
    lengths_path = out / "sample_lengths.json"
    lengths = json.loads(lengths_path.read_text()) if lengths_path.exists() else None
    return {
        "samples": len(samples),
        "expected_samples": len(dataset),
        "tokens": sum(map(len, ids)),
        "assistant_tokens": int(sum(int(s["loss_mask"].sum()) for s in samples)),
        "input_ids_match_preprocessing": all(dataset[i]["input_ids"].tolist() == x for i, x in enumerate(ids)),
        "loss_masks_match_preprocessing": all(
            dataset[i]["loss_mask"].tolist() == s["loss_mask"].tolist() for i, s in enumerate(samples)
        ),
        "sample_lengths": "absent" if lengths is None else lengths == {str(i): len(x) for i, x in enumerate(ids)},
        "max_rel_diff_vs_hf": worst,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", type=Path, help="speculators' scripts/data_generation_offline.py (required)")
    parser.add_argument("--speculators", type=Path, help="that release's install directory (required)")
    parser.add_argument("--datasets", type=Path, default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--samples", type=int, default=26)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "spec_compat" / "speculators_script")
    parser.add_argument("--check", nargs=4, metavar=("OUT", "MODEL", "DATA", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check(*(Path(x) for x in args.check))))
        return 0
    if args.script is None or args.speculators is None:
        parser.error("--script and --speculators are required")

    args.work.mkdir(parents=True, exist_ok=True)
    model, data = _model(args.work), _conversations(args.work / "conversations.jsonl", args.samples)
    out, cache = args.work / "out", args.work / "hf_cache"
    for directory in (out, cache):
        shutil.rmtree(directory, ignore_errors=True)
    out.mkdir()
    layers = [str(x) for x in LAYER_IDS]
    command = [
        sys.executable, "-m", "spec_compat", "run", "--dtype", "float32", "--", "python", str(args.script),
        "--target-model-path", str(model), "--train-data-path", str(data), "--output-dir", str(out),
        "--seq-length", str(SEQ_LENGTH), "--layer-ids", *layers, "--batch-size", str(args.batch_size),
        "--tensor-parallel-size", str(args.tp), "--num-preprocessing-workers", "1", "--hf-cache-dir", str(cache),
        "--token-freq-path", str(out / "token_freq.pt"),
    ]  # fmt: skip
    started = time.perf_counter()
    run = subprocess.run(command, env=_env(args), capture_output=True, text=True, timeout=1200)
    wall_s = time.perf_counter() - started
    (args.work / "script_output.txt").write_text(run.stdout + run.stderr)
    output = run.stdout + run.stderr
    figures: dict[str, Any] = {
        "script": str(args.script),
        "tp": args.tp,
        "exit_code": run.returncode,
        "wall_s": round(wall_s, 1),
        "traceback_in_output": "Traceback" in output or "Exception ignored" in output,
    }
    if run.returncode == 0:
        checker = [sys.executable, "-m", "spec_compat", "run", "--", "python", __file__, "--check"]
        checked = subprocess.run(
            [*checker, str(out), str(model), str(data), str(cache / "check")],
            env=_env(args), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if checked.returncode != 0:
            print(checked.stderr[-3000:], file=sys.stderr)
            return 1
        figures.update(json.loads(checked.stdout.strip().splitlines()[-1]))
    else:
        print(output[-4000:], file=sys.stderr)
    print(json.dumps(figures))
    ok = (
        run.returncode == 0
        and not figures["traceback_in_output"]
        and figures["samples"] == figures["expected_samples"] == args.samples
        and figures["input_ids_match_preprocessing"]
        and figures["loss_masks_match_preprocessing"]
        and figures["sample_lengths"] in (True, "absent")
        and figures["max_rel_diff_vs_hf"] <= 1e-3
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
