"""User options, passed from the driver to vLLM worker processes through the environment."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from types import ModuleType

from .detect import Environment

DTYPE_ENV = "SPEC_COMPAT_DTYPE"
# Set only while spec_compat's executor starts its workers, so that the worker-side adapters
# run in those workers and nowhere else (other vLLM engines in the process are untouched).
WORKER_ENV = "SPEC_COMPAT_WORKER_OPTIONS"

VALID_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")


@dataclass(frozen=True)
class Options:
    """``dtype``: the model dtype the generator loads with (speculators hard-codes "auto", which
    vLLM on CPU turns into bfloat16 even for a float32 checkpoint). ``check_results``: verify
    every ``generate()`` result against the output contract."""

    dtype: str | None = None
    check_results: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in VALID_DTYPES:
            raise ValueError(f"dtype must be one of {VALID_DTYPES} or None, got {self.dtype!r}")

    @classmethod
    def from_env(cls, dtype: str | None = None, check_results: bool = True) -> Options:
        return cls(dtype=dtype if dtype is not None else os.environ.get(DTYPE_ENV) or None, check_results=check_results)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Options:
        return cls(**json.loads(text))


@dataclass
class Context:
    env: Environment
    options: Options
    generator: ModuleType | None = None  # speculators.data_generation.vllm_hidden_states_generator
    worker: ModuleType | None = None  # speculators.data_generation.custom_worker
