"""Stand-ins for vLLM callables under a speculators module's own names.

A ``CallAdapter`` adapts the *keywords* a caller passes to the signature of the callable it
wraps. The keyword changes are declared (not hidden in code) so that preflight can bind the
caller's exact keyword set against the real signature without calling anything.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

ValueFn = Callable[[dict[str, Any]], Any]


def signature_of(target: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(target)


def accepts(target: Callable[..., Any], name: str) -> bool:
    params = signature_of(target).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def required(target: Callable[..., Any], name: str) -> bool:
    param = signature_of(target).parameters.get(name)
    return (
        param is not None
        and param.default is param.empty
        and param.kind
        in (
            param.POSITIONAL_OR_KEYWORD,
            param.KEYWORD_ONLY,
        )
    )


@dataclass
class KeywordPlan:
    """Keyword changes applied to every call: drop, add when absent, or override."""

    drop: frozenset[str] = frozenset()
    add: dict[str, ValueFn] = field(default_factory=dict)
    override: dict[str, ValueFn] = field(default_factory=dict)

    def names_after(self, names: Iterable[str]) -> set[str]:
        result = {n for n in names if n not in self.drop}
        result.update(self.add)
        result.update(self.override)
        return result

    def apply(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        result = {k: v for k, v in kwargs.items() if k not in self.drop}
        for name, value_fn in self.add.items():
            if name not in result:
                result[name] = value_fn(result)
        for name, value_fn in self.override.items():
            result[name] = value_fn(result)
        return result

    def __bool__(self) -> bool:
        return bool(self.drop or self.add or self.override)

    @classmethod
    def add_where_accepted(cls, target: Callable[..., Any], name: str, value_fn: ValueFn) -> KeywordPlan:
        """Add ``name`` where ``target`` takes it, drop it where it does not: the plan for a
        keyword that some releases require and others do not have."""
        return cls(add={name: value_fn}) if accepts(target, name) else cls(drop=frozenset({name}))


class CallAdapter:
    """Calls ``target`` with adapted keywords; ``after`` may post-process the result."""

    def __init__(
        self,
        adapter_id: str,
        target: Callable[..., Any],
        plan: KeywordPlan,
        after: Callable[[Any, dict[str, Any]], Any] | None = None,
    ) -> None:
        self.adapter_id = adapter_id
        self.__wrapped__ = target
        self.plan = plan
        self.after = after
        functools.update_wrapper(self, target, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        adapted = self.plan.apply(kwargs)
        result = self.__wrapped__(*args, **adapted)
        return self.after(result, adapted) if self.after is not None else result

    def __repr__(self) -> str:
        return f"<spec_compat {self.adapter_id} adapter for {self.__wrapped__!r}>"


def innermost(target: Any) -> Any:
    while isinstance(target, CallAdapter):
        target = target.__wrapped__
    return target


def names_reaching_target(target: Any, names: Iterable[str]) -> tuple[Any, set[str]]:
    """Follow a chain of CallAdapters: the real callable and the keywords that reach it."""
    current = set(names)
    while isinstance(target, CallAdapter):
        current = target.plan.names_after(current)
        target = target.__wrapped__
    return target, current


def bind_problem(target: Callable[..., Any], n_positional: int, names: Iterable[str]) -> str | None:
    """None when a call with these keywords binds to ``target``; otherwise why not."""
    try:
        sig = signature_of(target)
    except (TypeError, ValueError) as exc:
        return f"no signature: {exc}"
    try:
        sig.bind(*([None] * n_positional), **dict.fromkeys(names))
    except TypeError as exc:
        return str(exc)
    return None
