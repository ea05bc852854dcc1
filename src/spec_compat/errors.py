"""Exceptions spec_compat raises; each says what was expected and what was found."""

from __future__ import annotations


class SpecCompatError(RuntimeError):
    """Base class."""


class IncompatibleError(SpecCompatError):
    """apply(strict=True) or preflight found something it cannot make compatible."""


class ResultContractError(SpecCompatError):
    """The generator returned results that break the output contract."""


class WorkerError(SpecCompatError):
    """An exception raised inside a vLLM worker process, with its type, rank and traceback."""

    def __init__(self, exc_type: str, message: str, rank: int | None, remote_traceback: str, method: str) -> None:
        self.exc_type = exc_type
        self.message = message
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.method = method
        rank_text = "unknown rank" if rank is None else f"TP rank {rank}"
        shown = message if message else "(empty message)"
        super().__init__(
            f"{exc_type}: {shown} [in worker {rank_text}, during {method!r}]\n"
            f"--- remote traceback ---\n{remote_traceback.rstrip()}"
        )
