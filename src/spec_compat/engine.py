"""The apply engine: which adapters apply here, their patches, and the report (``apply()``,
``revert()``, ``plan()`` and the two worker-process entry points), around one state object.

The package face (``spec_compat/__init__.py``) re-exports the public names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from .adapters.driver.executor import entry as executor_entry
from .detect import Environment, detect
from .errors import IncompatibleError
from .options import Context, Options
from .patching import Patcher
from .preflight import Finding

VERSION = "0.1.0"


@dataclass(frozen=True)
class AdapterDecision:
    id: str
    side: str
    applies: bool
    reason: str
    blocking: bool = False


@dataclass
class Report:
    env: Environment
    options: Options
    decisions: list[AdapterDecision] = field(default_factory=list)
    preflight: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        return [d.id for d in self.decisions if d.applies]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [
            f"spec_compat {VERSION}: vLLM {self.env.vllm.describe()} ({self.env.vllm_distribution}), "
            f"speculators {self.env.speculators.describe()}, platform {self.env.platform}"
        ]
        for d in self.decisions:
            mark = "APPLY" if d.applies else ("BLOCK" if d.blocking else "  -  ")
            lines.append(f"  [{mark}] {d.id:34s} {d.reason}")
        bad = [f for f in self.preflight if not f.ok]
        lines.append(f"  preflight: {len(self.preflight) - len(bad)}/{len(self.preflight)} checks pass")
        lines.extend(f"    FAIL {f.what}: {f.detail}" for f in bad)
        lines.extend(f"  problem: {p}" for p in self.problems)
        return "\n".join(lines)


@dataclass
class EngineState:
    """Everything apply() keeps between calls in this process, behind ``lock``."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    patcher: Patcher = field(default_factory=Patcher)  # every live patch, whichever entry point made it
    report: Report | None = None  # the last apply() / apply_in_worker() (None: nothing applied)
    # Import-side decisions made by apply_before_import() (spec-compat run's hook, at speculators'
    # first import); apply() / apply_in_worker() / plan() report them instead of probing again.
    early_import: Report | None = None
    worker_process_applied: bool = False  # apply_in_worker() ran here (its worker-process side too)


STATE = EngineState()


def run_side(ctx: Context, side: str, report: Report, patcher: Patcher | None) -> None:
    from .registry import ADAPTERS

    for adapter in ADAPTERS:
        if adapter.side != side:
            continue
        if adapter.id in ctx.options.disable:
            report.decisions.append(AdapterDecision(adapter.id, side, False, "disabled by the user"))
            continue
        excluded = adapter.speculators_excludes(ctx.env.speculators)
        if excluded is not None:
            report.decisions.append(AdapterDecision(adapter.id, side, False, excluded))
            continue
        try:
            probe = adapter.probe(ctx)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a finding, not a crash
            report.decisions.append(
                AdapterDecision(adapter.id, side, False, f"probe failed: {type(exc).__name__}: {exc}", True)
            )
            report.problems.append(f"{adapter.id}: probe failed: {type(exc).__name__}: {exc}")
            continue
        report.decisions.append(AdapterDecision(adapter.id, side, probe.applies, probe.reason, probe.blocking))
        if probe.blocking:
            report.problems.append(f"{adapter.id}: {probe.reason}")
        if probe.applies and patcher is not None:
            adapter.install(ctx, patcher)


def _run_import_side(ctx: Context, report: Report, patcher: Patcher | None) -> None:
    early = STATE.early_import
    if early is not None:  # the hook's import-side patches are live in this process
        report.decisions.extend(early.decisions)
        report.problems.extend(early.problems)
        return
    run_side(ctx, "import", report, patcher)


def _load_speculators(ctx: Context, report: Report) -> bool:
    from .adapters import speculators_code

    try:
        ctx.worker = speculators_code.import_worker()
        ctx.generator = speculators_code.import_generator()
    except ImportError as exc:
        report.problems.append(f"cannot import speculators' generator: {type(exc).__name__}: {exc}")
        return False
    return True


def _build(options: Options, patcher: Patcher, keep_patches: bool) -> Report:
    env = detect()
    ctx = Context(env=env, options=options)
    report = Report(env=env, options=options)
    if env.vllm_distribution is None:
        report.problems.append("vLLM is not installed")
        return report
    _run_import_side(ctx, report, patcher)
    if _load_speculators(ctx, report):
        run_side(ctx, "worker", report, patcher)
        run_side(ctx, "driver", report, patcher if keep_patches else None)
        if keep_patches:
            from .preflight import check_generator, check_plugin_registered, worker_rpc_names

            assert ctx.generator is not None
            report.preflight = check_generator(ctx.generator, ctx.worker, worker_rpc_names(ctx.worker))
            report.preflight.append(check_plugin_registered())
            report.problems.extend(f"preflight: {f.what}: {f.detail}" for f in report.preflight if not f.ok)
    return report


def apply(
    strict: bool = False,
    dtype: str | None = None,
    check_results: bool = True,
    disable: Iterable[str] = (),
    worker_log_level: str | None = None,
    rpc_timeout_s: float | None = None,
    attention_backend: str | None = None,
) -> Report:
    """Make the installed speculators generator work on the installed vLLM. Idempotent.

    ``dtype``: the model dtype the generator loads with ("float32", "bfloat16", ...; default: the
    ``SPEC_COMPAT_DTYPE`` environment variable, else speculators' "auto").
    ``strict``: raise IncompatibleError if anything cannot be made compatible.
    ``disable``: adapter ids to leave out (also ``SPEC_COMPAT_DISABLE``), for diagnosis.
    ``worker_log_level``: e.g. "INFO" to see speculators' worker log lines from every TP worker,
    prefixed with the rank (also ``SPEC_COMPAT_WORKER_LOG_LEVEL``).
    ``rpc_timeout_s``: deadline in seconds of every worker RPC and model step of generate() (also
    ``SPEC_COMPAT_RPC_TIMEOUT``; default 1800, see options.DEFAULT_RPC_TIMEOUT_S). When it passes,
    ``WorkerTimeout`` names the ranks that answered and those that did not, with their stacks and
    process states, and the engine is shut down. The engine load has no deadline.
    ``attention_backend``: the vLLM attention backend the engine uses, an ``AttentionBackendEnum`` name
    (also ``SPEC_COMPAT_ATTENTION_BACKEND``; default: vLLM chooses). "CPU_MLA" runs a float32 MLA model
    (DeepSeek-V3, Kimi-K2.5) on a CPU with AMX, where vLLM picks its bfloat16-only AMX_MLA backend.
    """
    from .registry import BY_ID

    unknown = sorted(set(disable) - set(BY_ID))
    if unknown:
        raise ValueError(f"unknown adapter ids {unknown}; known: {sorted(BY_ID)}")
    options = Options.from_env(
        dtype=dtype,
        check_results=check_results,
        disable=tuple(disable),
        worker_log_level=worker_log_level,
        rpc_timeout_s=rpc_timeout_s,
        attention_backend=attention_backend,
    )
    state = STATE
    with state.lock:
        if state.report is not None and state.report.options == options:
            report = state.report
        else:
            early = state.early_import
            if state.report is not None or (early is not None and early.options.disable != options.disable):
                state.patcher.revert()
                state.early_import = None
            report = _build(options, state.patcher, keep_patches=True)
            state.report = report
            state.early_import = None
    if strict and not report.ok:
        raise IncompatibleError("spec_compat cannot make this environment compatible:\n" + str(report))
    return report


def revert() -> list[str]:
    """Undo every patch apply() made; returns the patched targets, last applied first."""
    state = STATE
    with state.lock:
        undone = state.patcher.revert()
        state.report = None
        state.early_import = None
    return [f"{p.adapter_id}: {p.target}" for p in undone]


def plan(dtype: str | None = None, check_results: bool = True) -> Report:
    """What apply() would do and why, without leaving any patch behind."""
    with STATE.lock:
        if STATE.report is not None:
            return STATE.report
        scratch = Patcher()
        try:
            return _build(Options.from_env(dtype=dtype, check_results=check_results), scratch, keep_patches=False)
        finally:
            scratch.revert()


def apply_in_worker(options_json: str) -> Report:
    """Worker-process side (the vLLM plugin, or spec_compat's worker entry point): import-time,
    worker and worker-process adapters. Under fork the driver's patches are inherited and only
    the worker-process adapters are added."""
    options = Options.from_json(options_json)
    state = STATE
    with state.lock:
        if state.worker_process_applied and state.report is not None:
            return state.report
        from .adapters import speculators_code

        env = detect()
        ctx = Context(env=env, options=options)
        if state.report is None:
            report = Report(env=env, options=options)
            _run_import_side(ctx, report, state.patcher)
            ctx.worker = speculators_code.import_worker()
            run_side(ctx, "worker", report, state.patcher)
        else:
            report = state.report
            ctx.worker = speculators_code.import_worker()
        run_side(ctx, "worker-process", report, state.patcher)
        if options.worker_log_level:
            from .worker_logs import show_worker_logs

            show_worker_logs(options.worker_log_level)
        state.worker_process_applied = True
        state.report = report
        return report


# spec_compat's worker entry point (adapters/driver/executor/entry.py) runs this in every worker it starts.
executor_entry.set_worker_setup(apply_in_worker)


def apply_before_import() -> Report:
    """Only the import-side adapters (what ``import speculators`` itself needs), options from the
    environment; speculators is not imported. ``spec-compat run``'s hook calls it when a process
    first imports speculators, so that a process which never builds a generator (a spawned vLLM
    worker re-importing its parent's ``__main__``, a training script) pays for nothing else. A
    later apply() or apply_in_worker() keeps these patches and reports them. Idempotent."""
    state = STATE
    with state.lock:
        if state.report is not None:
            return state.report
        if state.early_import is None:
            options = Options.from_env()
            env = detect()
            report = Report(env=env, options=options)
            if env.vllm_distribution is None:
                report.problems.append("vLLM is not installed")
            else:
                run_side(Context(env=env, options=options), "import", report, state.patcher)
            state.early_import = report
        return state.early_import
