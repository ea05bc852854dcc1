"""User options, passed from the driver to vLLM worker processes through the environment."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from types import ModuleType

from .detect import Environment

DTYPE_ENV = "SPEC_COMPAT_DTYPE"
DISABLE_ENV = "SPEC_COMPAT_DISABLE"  # comma-separated adapter ids to leave out (for diagnosis)
WORKER_LOG_ENV = "SPEC_COMPAT_WORKER_LOG_LEVEL"  # e.g. INFO: show speculators' worker log lines
# Set only while spec_compat's executor starts its workers, so that the worker-side adapters
# run in those workers and nowhere else (other vLLM engines in the process are untouched).
WORKER_ENV = "SPEC_COMPAT_WORKER_OPTIONS"

VALID_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
VALID_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Options:
    """``dtype``: the model dtype the generator loads with (speculators hard-codes "auto", which
    vLLM on CPU turns into bfloat16 even for a float32 checkpoint). ``check_results``: verify
    every ``generate()`` result against the output contract. ``disable``: adapter ids to leave
    out, to see what a break looks like without its adapter. ``worker_log_level``: show log lines
    of speculators' worker code (and spec_compat's) from every TP worker at this level, prefixed
    with the rank (vLLM only configures its own loggers there, so INFO lines are lost)."""

    dtype: str | None = None
    check_results: bool = True
    disable: tuple[str, ...] = ()
    worker_log_level: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in VALID_DTYPES:
            raise ValueError(f"dtype must be one of {VALID_DTYPES} or None, got {self.dtype!r}")
        if self.worker_log_level is not None and self.worker_log_level.upper() not in VALID_LOG_LEVELS:
            raise ValueError(f"worker_log_level must be one of {VALID_LOG_LEVELS}, got {self.worker_log_level!r}")

    @classmethod
    def from_env(
        cls,
        dtype: str | None = None,
        check_results: bool = True,
        disable: tuple[str, ...] = (),
        worker_log_level: str | None = None,
    ) -> Options:
        from_env = tuple(x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip())
        return cls(
            dtype=dtype if dtype is not None else os.environ.get(DTYPE_ENV) or None,
            check_results=check_results,
            disable=tuple(sorted(set(disable) | set(from_env))),
            worker_log_level=worker_log_level or os.environ.get(WORKER_LOG_ENV) or None,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Options:
        values = json.loads(text)
        values["disable"] = tuple(values.get("disable", ()))
        return cls(**values)


@dataclass
class Context:
    env: Environment
    options: Options
    generator: ModuleType | None = None  # speculators.data_generation.vllm_hidden_states_generator
    worker: ModuleType | None = None  # speculators.data_generation.custom_worker
