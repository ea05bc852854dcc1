"""User options, passed from the driver to vLLM worker processes through the environment."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from types import ModuleType

from .detect import Environment

DTYPE_ENV = "SPEC_COMPAT_DTYPE"
DISABLE_ENV = "SPEC_COMPAT_DISABLE"  # comma-separated adapter ids to leave out (for diagnosis)
# Set only while spec_compat's executor starts its workers, so that the worker-side adapters
# run in those workers and nowhere else (other vLLM engines in the process are untouched).
WORKER_ENV = "SPEC_COMPAT_WORKER_OPTIONS"

VALID_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")


@dataclass(frozen=True)
class Options:
    """``dtype``: the model dtype the generator loads with (speculators hard-codes "auto", which
    vLLM on CPU turns into bfloat16 even for a float32 checkpoint). ``check_results``: verify
    every ``generate()`` result against the output contract. ``disable``: adapter ids to leave
    out, to see what a break looks like without its adapter."""

    dtype: str | None = None
    check_results: bool = True
    disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in VALID_DTYPES:
            raise ValueError(f"dtype must be one of {VALID_DTYPES} or None, got {self.dtype!r}")

    @classmethod
    def from_env(cls, dtype: str | None = None, check_results: bool = True, disable: tuple[str, ...] = ()) -> Options:
        from_env = tuple(x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip())
        return cls(
            dtype=dtype if dtype is not None else os.environ.get(DTYPE_ENV) or None,
            check_results=check_results,
            disable=tuple(sorted(set(disable) | set(from_env))),
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
