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


class WorkerTimeout(WorkerError):
    """A worker RPC or model step got no reply within its deadline (``apply(rpc_timeout_s=...)``).

    ``answered`` / ``stuck``: the TP ranks that replied and those that did not; ``stacks``: each
    rank's Python stack (all threads) taken at the deadline; ``states``: each rank's process state
    then (alive / zombie / exited with code ...). The engine was shut down before this was raised.
    """

    def __init__(
        self,
        method: str,
        timeout_s: float,
        answered: list[int],
        stuck: list[int],
        stacks: dict[int, str],
        states: dict[int, str],
        shutdown: str,
    ) -> None:
        self.timeout_s = timeout_s
        self.answered = answered
        self.stuck = stuck
        self.stacks = stacks
        self.states = states
        self.shutdown = shutdown

        def ranks(values: list[int]) -> str:
            return ", ".join(f"TP rank {r}" for r in values) or "none"

        message = (
            f"no reply to {method!r} within its {timeout_s:g} s deadline (apply(rpc_timeout_s=...) / "
            f"SPEC_COMPAT_RPC_TIMEOUT); answered: {ranks(answered)}; no reply: {ranks(stuck)}; {shutdown}"
        )
        sections = ["--- process states at the deadline ---\n" + "\n".join(states[r] for r in sorted(states))]
        for rank in sorted(stacks):
            sections.append(
                f"--- TP rank {rank}: Python stack at the deadline (all threads) ---\n{stacks[rank].rstrip()}"
            )
        self.exc_type = "WorkerTimeout"
        self.message = message
        self.rank = stuck[0] if stuck else None
        self.remote_traceback = "\n".join(sections)
        self.method = method
        rank_text = "unknown rank" if self.rank is None else f"TP rank {self.rank}"
        SpecCompatError.__init__(
            self, f"WorkerTimeout: {message} [in worker {rank_text}, during {method!r}]\n{self.remote_traceback}"
        )


class EngineStopped(SpecCompatError):
    """The engine was shut down after a failure or an interruption; this generator cannot run again."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"spec_compat: this generator's engine was shut down ({reason}); create a new "
            "VllmHiddenStatesGenerator to continue"
        )
