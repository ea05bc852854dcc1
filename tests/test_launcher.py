"""``spec-compat run -- COMMAND``: the launcher, its start-up hook, and a real client run unmodified under it.

The engine tests run ``tests/client_pipeline.py`` (shaped like speculators' offline pipeline:
speculators imported at module level, spawned workers, batches of 12, a thread pool saving
``data_{i}.pt``) as ``spec-compat run --dtype float32 -- python tests/client_pipeline.py ...`` for
both speculators versions at TP=1 and TP=2, and check every saved sample against HF transformers,
its loss mask and its length, a clean exit (no traceback at interpreter exit) and that no worker
outlives the run. The others check the launcher's plumbing without a model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_constants import LAYER_IDS, MAX_MODEL_LEN, TESTED_SPECULATORS

from engine_harness import CellPool, model_dir, prompts, require_speculators
from spec_compat.adapters.transfer import DIR_PREFIX
from spec_compat.adapters.transfer import _base_directory as transfer_base
from test_engine import TOLERANCE, _max_rel_diff, hf_reference

CELLS = Path(__file__).resolve().parent / "cells"
CLIENT = CELLS / "client_pipeline.py"
VENV_BIN = str(Path(sys.executable).parent)
TAG_ENV = "SPEC_COMPAT_TEST_TAG"  # marks every process of one run, to find survivors in /proc
BATCH_SIZE = 12


def _env(**extra: str) -> dict[str, str]:
    """This test process's environment without any launcher of its own, the venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEC_COMPAT_RUN") and k != "SPEC_COMPAT_STRICT"}
    env.pop("SPEC_COMPAT_DTYPE", None)
    env.pop("SPEC_COMPAT_DISABLE", None)
    hook = str(Path(__file__).resolve().parent.parent / "src" / "spec_compat" / "_run_hook")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(hook).resolve()]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env or _env(), capture_output=True, text=True, timeout=timeout)


# ---- the launcher's plumbing (no model) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["spec-compat", "run", "--", "python", "-c", "raise SystemExit(7)"], 7),
        ([sys.executable, "-m", "spec_compat", "run", "--", "python", "-c", "raise SystemExit(3)"], 3),
        (["spec-compat", "run", "--", "sh", "-c", "kill -TERM $$"], -signal.SIGTERM),
        (["spec-compat", "run", "--", "true"], 0),
        (["spec-compat", "run", "--", "no-such-command-spec-compat"], 127),
        (["spec-compat", "run", "--dtype", "float64", "--", "true"], 2),
        (["spec-compat", "run", "--disable", "no-such-adapter", "--", "true"], 2),
    ],
    ids=["exit-7", "python-m-exit-3", "killed-by-sigterm", "true", "not-found", "bad-dtype", "bad-adapter"],
)
def test_exit_code_passes_through(command: list[str], code: int) -> None:
    proc = _run(command)
    assert proc.returncode == code, proc.stderr
    if code in (2, 127):
        assert proc.stderr.strip().splitlines()[-1].startswith("spec"), proc.stderr  # one line says why


def test_signals_reach_the_command_itself() -> None:
    """exec: the command has the launcher's pid, so a signal sent to it is the command's to handle."""
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        ["spec-compat", "run", "--", "python", "-c", script], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert int(proc.stdout.readline()) == proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42


def test_pytest_under_the_launcher(tmp_path: Path) -> None:
    """`spec-compat run -- pytest ...`: pytest is the launched process (hooked), its exit status passes through."""
    (tmp_path / "test_hooked.py").write_text(
        "import os, sys\n"
        "def test_hooked():\n"
        "    assert os.environ['SPEC_COMPAT_RUN'] == str(os.getpid())\n"
        "    assert any(type(f).__name__ == 'SpeculatorsImportHook' for f in sys.meta_path)\n"
        "def test_fails():\n"
        "    assert False\n"
    )
    proc = _run(["spec-compat", "run", "--", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout


REPORT_CHILD = (
    "import json, os, sys\n"
    "print(json.dumps({'hook': [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "
    "'SpeculatorsImportHook'], 'spec_compat_imported': 'spec_compat' in sys.modules, "
    "'launched': os.environ.get('SPEC_COMPAT_RUN') == str(os.getpid())}))\n"
)


def test_options_children_and_untouched_children() -> None:
    """Options become variables; a Python child has the hook (without importing spec_compat: cheap),
    a child started without SPEC_COMPAT_RUN has nothing."""
    script = (
        "import json, os, subprocess, sys\n"
        "def child(env):\n"
        "    out = subprocess.run([sys.executable, '-c', sys.argv[1]], env=env, capture_output=True, text=True)\n"
        "    return json.loads(out.stdout)\n"
        "plain = {k: v for k, v in os.environ.items() if k != 'SPEC_COMPAT_RUN'}\n"
        "print(json.dumps({'env': {k: os.environ.get(k) for k in "
        "('SPEC_COMPAT_DTYPE', 'SPEC_COMPAT_DISABLE', 'SPEC_COMPAT_WORKER_LOG_LEVEL', 'SPEC_COMPAT_STRICT')}, "
        "'child': child(dict(os.environ)), 'without_env': child(plain)}))\n"
    )
    command = ["spec-compat", "run", "--dtype", "float32", "--disable", "input-order,sequence-limit"]
    command += ["--worker-log-level", "info", "--strict", "--", "python", "-c", script, REPORT_CHILD]
    proc = _run(command)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["env"] == {
        "SPEC_COMPAT_DTYPE": "float32",
        "SPEC_COMPAT_DISABLE": "input-order,sequence-limit",
        "SPEC_COMPAT_WORKER_LOG_LEVEL": "INFO",
        "SPEC_COMPAT_STRICT": "1",
    }
    assert out["child"] == {"hook": ["SpeculatorsImportHook"], "spec_compat_imported": False, "launched": False}
    assert out["without_env"] == {"hook": [], "spec_compat_imported": False, "launched": False}
    assert proc.stderr == "", proc.stderr  # nothing said where nothing imported speculators


def test_users_sitecustomize_still_runs(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = __file__\n")
    script = (
        "import json, os, sys, sitecustomize\n"
        "print(json.dumps({'ran': os.environ.get('USER_SITECUSTOMIZE_RAN'), 'module': sitecustomize.__file__, "
        "'hook': any(type(f).__name__ == 'SpeculatorsImportHook' for f in sys.meta_path)}))\n"
    )
    env = _env(PYTHONPATH=str(user))
    proc = _run(["spec-compat", "run", "--", "python", "-c", script], env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"ran": str(user / "sitecustomize.py"), "module": str(user / "sitecustomize.py"), "hook": True}


def test_hook_failure_is_one_line_in_a_child_and_loud_in_the_command(tmp_path: Path) -> None:
    """A failing apply (here: an invalid SPEC_COMPAT_DTYPE, set behind the launcher's back) prints
    one line in an unrelated child, which goes on, and raises in the launched command itself."""
    fake = tmp_path / "fake"
    (fake / "speculators").mkdir(parents=True)
    (fake / "speculators" / "__init__.py").write_text("")
    child = "import speculators; print('child went on')"
    script = (
        "import subprocess, sys\n"
        f"out = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
        "print(out.returncode, out.stdout.strip(), file=sys.stdout)\n"
        "print(out.stderr, end='', file=sys.stdout)\n"
        "sys.stdout.flush()\n"
        "import speculators\n"
    )
    env = _env(PYTHONPATH=str(fake), SPEC_COMPAT_DTYPE="float64")
    proc = _run(["spec-compat", "run", "--", "python", "-c", script], env=env)
    child_lines = proc.stdout.strip().splitlines()
    assert child_lines[0] == "0 child went on", proc.stdout
    assert len(child_lines) == 2, proc.stdout
    assert child_lines[1].startswith("spec_compat run: applying the import-side adapters failed in pid "), child_lines
    assert "ValueError: dtype must be one of" in child_lines[1], child_lines
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr and "ValueError: dtype must be one of" in proc.stderr, proc.stderr


# ---- a real client, unmodified, under the launcher ----------------------------------------------------


def _loss_mask(index: int, length: int) -> list[int]:
    """A different mask per sample, so a sample saved under another's index is caught."""
    return [int((7 * t + index) % 5 < 3) for t in range(length)]


def _dataset(path: Path) -> Path:
    with path.open("w") as handle:
        for i, ids in enumerate(prompts()):
            handle.write(json.dumps({"input_ids": ids, "loss_mask": _loss_mask(i, len(ids))}) + "\n")
    return path


def _engine_env(speculators: str, tp: int, tag: str, core: str | None) -> dict[str, str]:
    return _env(
        PYTHONPATH=str(require_speculators(speculators)),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=core or "|".join(str(i) for i in range(tp)),
        **{TAG_ENV: tag},
    )


def _client_args(data: Path, out: Path, tp: int) -> list[str]:
    layers = [str(x) for x in LAYER_IDS]
    return [
        str(CLIENT), "--model", str(model_dir("dense")), "--data", str(data), "--output-dir", str(out),
        "--layer-ids", *layers, "--tp", str(tp), "--batch-size", str(BATCH_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip


def _survivors(tag: str, grace_s: float = 10.0) -> list[str]:
    """Processes still carrying this run's tag (orphaned workers), after a grace period."""
    needle = f"{TAG_ENV}={tag}".encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{entry.name}: {command[:120]}")
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


RUNNER = (
    "import runpy, sys, spec_compat\n"
    "spec_compat.apply(dtype='float32')\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@dataclass
class ClientResult:
    proc: subprocess.CompletedProcess[str]
    pid: int  # the client's (spec-compat run execs it)
    elapsed: float
    out: Path
    survivors: list[str]  # processes still carrying the run's tag 10 s after it exited


@dataclass(frozen=True)
class ClientRun:
    """The client on the dense model in the job's directory, under ``spec-compat run`` (``launcher``)
    or with ``spec_compat.apply()`` in a runner script before it (a pool job: one core per TP rank)."""

    speculators: str
    tp: int
    launcher: bool = True

    @property
    def name(self) -> str:
        return f"client-spec{self.speculators}-tp{self.tp}" + ("" if self.launcher else "-apply-in-runner")

    @property
    def cores(self) -> int:
        return self.tp

    def run(self, work: Path, core: str | None) -> ClientResult:
        data, out, tag = _dataset(work / "data.jsonl"), work / "out", uuid.uuid4().hex
        env = _engine_env(self.speculators, self.tp, tag, core)
        started = time.perf_counter()
        if self.launcher:
            command = ["spec-compat", "run", "--dtype", "float32", "--", "python", *_client_args(data, out, self.tp)]
        else:
            command = ["python", "-c", RUNNER, *_client_args(data, out, self.tp)]
        popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = popen.communicate(timeout=600)
        elapsed = time.perf_counter() - started
        proc = subprocess.CompletedProcess(command, popen.returncode, stdout, stderr)
        return ClientResult(proc, popen.pid, elapsed, out, _survivors(tag))


CLIENT_CELLS = [ClientRun(s, tp) for s in TESTED_SPECULATORS for tp in (1, 2)]


@pytest.mark.engine
@pytest.mark.parametrize("job", CLIENT_CELLS, ids=[f"spec{c.speculators}-tp{c.tp}" for c in CLIENT_CELLS])
def test_client_pipeline_under_launcher(job: ClientRun, engine_cells: CellPool) -> None:
    speculators, tp = job.speculators, job.tp
    run = engine_cells.result(job)
    proc, elapsed, out = run.proc, run.elapsed, run.out
    stderr = proc.stderr
    output = proc.stdout + stderr
    assert proc.returncode == 0, output[-6000:]
    assert "spec_compat run: spec_compat applied" in stderr and "; compatible)" in stderr, output[-3000:]
    # Clean exit: the engine was shut down while the interpreter was intact, and nothing survived it
    # (the client is the launcher's pid: exec), its shared-memory transfer directory included.
    assert "Traceback" not in output and "Exception ignored" not in output, output[-6000:]
    assert run.survivors == []
    assert not list(Path(transfer_base()).glob(f"{DIR_PREFIX}{run.pid}-*"))

    all_prompts = prompts()
    reference = hf_reference("dense")
    lengths = json.loads((out / "sample_lengths.json").read_text())
    assert lengths == {str(i): len(p) for i, p in enumerate(all_prompts)}
    saved: list[dict[str, Any]] = [torch.load(out / f"data_{i}.pt", weights_only=True) for i in range(len(all_prompts))]
    assert sorted(p.name for p in out.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(len(all_prompts)))
    for i, (sample, ids) in enumerate(zip(saved, all_prompts, strict=True)):
        assert sample["input_ids"].tolist() == ids, f"sample {i}: input_ids are another sample's"
        assert sample["loss_mask"].tolist() == _loss_mask(i, len(ids)), f"sample {i}: loss mask misaligned"
        assert [tuple(h.shape) for h in sample["hidden_states"]] == [(len(ids), 128)] * len(LAYER_IDS)
    diff = _max_rel_diff([[h.float() for h in s["hidden_states"]] for s in saved], reference)
    assert diff <= TOLERANCE, f"max relative diff vs HF {diff:.3e} > {TOLERANCE}"
    print(f"client under spec-compat run, speculators {speculators} TP={tp}: {elapsed:.1f} s, max rel diff {diff:.2e}")


@pytest.mark.engine
@pytest.mark.parametrize("job", [ClientRun("0.4.0.1", 1, launcher=False)], ids=["spec0.4.0.1-tp1"])
def test_client_pipeline_without_launcher_is_the_known_failure(job: ClientRun, engine_cells: CellPool) -> None:
    """spec_compat.apply() in the parent is not enough for an unmodified script: the spawned
    workers re-import its __main__ (speculators at module level) before vLLM loads plugins."""
    run = engine_cells.result(job)
    proc, out = run.proc, run.out
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "PydanticUndefinedAnnotation: name 'torch' is not defined" in output, output[-3000:]
    assert "WorkerProc initialization failed" in output, output[-3000:]
    assert not list(out.glob("data_*.pt"))
