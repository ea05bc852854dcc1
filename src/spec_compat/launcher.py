"""``spec-compat run -- COMMAND ...``: COMMAND, and every Python process it starts, with spec_compat applied.

Like ``opentelemetry-instrument`` / ``ddtrace-run``. The launcher prepends ``_run_hook/`` (a
directory holding only ``sitecustomize.py``) to ``PYTHONPATH``, sets ``SPEC_COMPAT_RUN`` (and the
option variables ``options.py`` reads) and ``exec``s COMMAND. Every Python process of the tree then
runs the hook at start-up, before its ``__main__`` is imported, and only while ``SPEC_COMPAT_RUN``
is in its environment. What happens in each process:

* **start-up** (every Python child: ``pip``, ``python -c``, a spawned vLLM worker): one finder is
  put first on ``sys.meta_path`` and the shadowed ``sitecustomize`` runs; spec_compat itself is not
  imported (it costs ~60 ms), so a child that never imports speculators pays nothing measurable.
* **first ``import speculators``** (``before_speculators_import``, from the start-up hook's
  finder: a *pre*-import hook, which wrapt does not offer): the import-side adapters
  (``apply_before_import()``: transformers' ``torch`` annotation, removed transformers modules,
  moved vLLM helpers) are applied before speculators' first line runs. This is what a spawned vLLM
  worker needs: multiprocessing's spawn re-imports the parent's ``__main__`` (which imports
  speculators at module level) before vLLM loads its plugins, and without it every worker died with
  ``PydanticUndefinedAnnotation: name 'torch' is not defined``.
* **after speculators' generator module is imported** (a ``wrapt`` post-import hook; not in vLLM
  workers started by spec_compat's executor, which get the worker-side adapters from the vLLM
  plugin as before): the full ``apply()`` (driver-side adapters and the preflight), unless the program already called
  ``spec_compat.apply()`` itself (its own options are kept).

Failures: in the launched process itself (the one ``exec`` turned the launcher into: same pid), a
failed apply raises from the import, with its traceback, and ``--strict`` turns any problem into
``IncompatibleError``; problems of a non-strict apply are printed, one line each. In any other
process a failure is one line on stderr and the process goes on (an unrelated child is never
killed by the hook). Interpreters run with ``-E``/``-I`` (PYTHONPATH ignored) or ``-S`` (no
``site``) are not reached; nor is a Python that cannot import this spec_compat (it says so, once).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import wrapt

from .options import DISABLE_ENV, DTYPE_ENV, VALID_DTYPES, VALID_LOG_LEVELS, WORKER_ENV, WORKER_LOG_ENV

RUN_ENV = "SPEC_COMPAT_RUN"  # the launcher's pid; the hook is active only where this is set
STRICT_ENV = "SPEC_COMPAT_STRICT"  # "1": the launched process raises IncompatibleError on any problem
HOOK_DIR = Path(__file__).resolve().parent / "_run_hook"
GENERATOR_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
PREFIX = "spec_compat run:"


# ---- the launcher ---------------------------------------------------------------------------------


def launch_environment(
    base: dict[str, str],
    dtype: str | None = None,
    disable: Sequence[str] = (),
    worker_log_level: str | None = None,
    strict: bool = False,
) -> dict[str, str]:
    """The environment COMMAND runs in: the hook directory first on PYTHONPATH, the options as variables."""
    env = dict(base)
    hook = str(HOOK_DIR)
    rest = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != hook]
    env["PYTHONPATH"] = os.pathsep.join([hook, *rest])
    env[RUN_ENV] = str(os.getpid())  # exec keeps the pid: this is COMMAND's pid
    if dtype is not None:
        env[DTYPE_ENV] = dtype
    if disable:
        known = [x.strip() for x in env.get(DISABLE_ENV, "").split(",") if x.strip()]
        env[DISABLE_ENV] = ",".join(dict.fromkeys([*known, *disable]))
    if worker_log_level is not None:
        env[WORKER_LOG_ENV] = worker_log_level.upper()
    if strict:
        env[STRICT_ENV] = "1"
    return env


def check_options(dtype: str | None, disable: Sequence[str], worker_log_level: str | None) -> str | None:
    """One line saying what is wrong with the launcher's options, or None."""
    if dtype is not None and dtype not in VALID_DTYPES:
        return f"--dtype must be one of {', '.join(VALID_DTYPES)}, got {dtype!r}"
    if worker_log_level is not None and worker_log_level.upper() not in VALID_LOG_LEVELS:
        return f"--worker-log-level must be one of {', '.join(VALID_LOG_LEVELS)}, got {worker_log_level!r}"
    if disable:
        from .registry import BY_ID

        unknown = sorted(set(disable) - set(BY_ID))
        if unknown:
            return f"--disable: unknown adapter ids {', '.join(unknown)} (`spec-compat doctor` lists them)"
    return None


def run(
    command: Sequence[str],
    dtype: str | None = None,
    disable: Sequence[str] = (),
    worker_log_level: str | None = None,
    strict: bool = False,
) -> int:
    """Replace this process by COMMAND with the hook active; returns only if COMMAND cannot start.

    ``os.execvpe`` rather than a subprocess: COMMAND *is* this process afterwards (same pid, same
    process group and terminal), so every signal (Ctrl-C's SIGINT to the foreground group, a
    scheduler's SIGTERM to the pid) reaches it directly, its exit status, a death by signal
    included, is what the caller sees, and no launcher stays in between to forward or translate
    anything. Exit codes when it cannot start follow the shells: 127 not found, 126 not executable.
    """
    if not command:
        print(f"{PREFIX} no command given (usage: spec-compat run [options] -- COMMAND [ARGS ...])", file=sys.stderr)
        return 2
    env = launch_environment(dict(os.environ), dtype, disable, worker_log_level, strict)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except FileNotFoundError:
        print(f"{PREFIX} command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"{PREFIX} permission denied: {command[0]}", file=sys.stderr)
        return 126
    except OSError as exc:
        print(f"{PREFIX} cannot run {command[0]}: {exc}", file=sys.stderr)
        return 126
    return 0  # not reached: exec does not return


# ---- inside the processes of the launched tree (called by _run_hook/sitecustomize.py) -------------


def is_launched_process() -> bool:
    """Is this the process the launcher exec'd into (the user's command), not one of its children?"""
    return os.environ.get(RUN_ENV, "") == str(os.getpid())


def is_spec_compat_worker() -> bool:
    """A vLLM worker started by spec_compat's executor (the vLLM plugin applies the worker side there)."""
    return bool(os.environ.get(WORKER_ENV))


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def _where() -> str:
    return f"pid {os.getpid()}, {' '.join(sys.argv[:3]) or sys.executable}"


def _guarded(step: str, action: Callable[[], None]) -> None:
    """Run ``action``; in the launched process a failure propagates, elsewhere it is one line."""
    try:
        action()
    except Exception as exc:
        if is_launched_process():
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _say(f"{step} failed in {_where()}: {type(exc).__name__}: {first} (this process goes on without it)")
        if os.environ.get("SPEC_COMPAT_RUN_DEBUG"):
            traceback.print_exc()


def before_speculators_import() -> None:
    """Called by the start-up hook when this process first imports speculators."""

    def import_side() -> None:
        from .engine import apply_before_import

        report = apply_before_import()
        if report.problems and is_launched_process():
            for problem in report.problems:
                _say(f"problem: {problem}")

    _guarded("applying the import-side adapters", import_side)
    if not is_spec_compat_worker():
        # wrapt's post-import hook: after_generator_import runs once the generator module has
        # executed (at once if it already has), and the module keeps its own loader (getsource).
        wrapt.register_post_import_hook(after_generator_import, GENERATOR_MODULE)


def after_generator_import(module: ModuleType) -> None:
    """Called once speculators' generator module has been executed: the full apply()."""

    def full_apply() -> None:
        import spec_compat
        from spec_compat.engine import STATE

        if STATE.report is not None:  # the program called apply() itself: keep its options
            return
        strict = os.environ.get(STRICT_ENV) == "1" and is_launched_process()
        report = spec_compat.apply(strict=strict)
        if is_launched_process():
            for problem in report.problems:
                _say(f"problem: {problem}")
            state = "compatible" if report.ok else f"{len(report.problems)} problem(s)"
            _say(
                f"spec_compat applied ({len(report.applied)} adapters; vLLM {report.env.vllm.describe()}, "
                f"speculators {report.env.speculators.describe()}; {state})"
            )

    _guarded("spec_compat.apply()", full_apply)
