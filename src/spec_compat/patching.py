"""Reversible attribute patches: every change records what it replaced, revert() puts it back."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

_MISSING: Any = object()


@dataclass
class Patch:
    adapter_id: str
    owner: Any
    name: str
    original: Any  # _MISSING when the attribute did not exist (an additive alias)
    replacement: Any
    item_of: str = ""  # set for a key of a mapping (sys.modules), not an attribute: the mapping's name
    undo: Callable[[], None] | None = None  # set for a change that is not an attribute (on_revert)

    @property
    def target(self) -> str:
        if self.undo is not None:
            return self.name
        if self.item_of:
            return f"{self.item_of}[{self.name!r}]"
        owner_name = getattr(self.owner, "__name__", type(self.owner).__name__)
        return f"{owner_name}.{self.name}"


class Patcher:
    """Applies patches and undoes them in reverse order. An adapter's apply never sees it: it gets
    ``scoped(adapter.id)``, so every patch it makes carries its registry id."""

    def __init__(self) -> None:
        self.patches: list[Patch] = []

    def scoped(self, adapter_id: str) -> AdapterPatcher:
        return AdapterPatcher(self, adapter_id)

    def replace(self, adapter_id: str, owner: Any, name: str, replacement: Any) -> Any:
        """Replace an existing attribute; returns the previous value."""
        original = vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
        self.patches.append(Patch(adapter_id, owner, name, original, replacement))
        setattr(owner, name, replacement)
        return original

    def add(self, adapter_id: str, owner: Any, name: str, value: Any) -> None:
        """Add an attribute that does not exist yet (an alias); never overwrites."""
        if name in vars(owner):
            raise RuntimeError(f"refusing to overwrite existing {owner!r}.{name} with an alias")
        self.patches.append(Patch(adapter_id, owner, name, _MISSING, value))
        setattr(owner, name, value)

    def add_item(
        self, adapter_id: str, mapping: MutableMapping[str, Any], mapping_name: str, key: str, value: Any
    ) -> None:
        """Add a key that does not exist yet to a mapping such as sys.modules; never overwrites."""
        if key in mapping:
            raise RuntimeError(f"refusing to overwrite existing {mapping_name}[{key!r}]")
        self.patches.append(Patch(adapter_id, mapping, key, _MISSING, value, item_of=mapping_name))
        mapping[key] = value

    def on_revert(self, adapter_id: str, description: str, undo: Callable[[], None]) -> None:
        """Record a change that is not an attribute (a signal handler, say): revert() calls ``undo``."""
        self.patches.append(Patch(adapter_id, None, description, _MISSING, None, undo=undo))

    def revert(self) -> list[Patch]:
        undone = list(reversed(self.patches))
        for patch in undone:
            if patch.undo is not None:
                patch.undo()
            elif patch.item_of:
                current = patch.owner.get(patch.name)
                # os.environ decodes a new str on every read: equal is as good as the same there
                if current is patch.replacement or (isinstance(current, str) and current == patch.replacement):
                    del patch.owner[patch.name]
            elif patch.original is _MISSING:
                if name_is_set(patch.owner, patch.name):
                    delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
        self.patches.clear()
        return undone


class AdapterPatcher:
    """The patcher as one adapter's apply sees it: the same methods without the id, every change
    recorded under ``adapter_id`` (the registry's, given by whoever runs the apply), so revert()
    and the report name the adapter that made it."""

    def __init__(self, patcher: Patcher, adapter_id: str) -> None:
        self.patcher = patcher
        self.adapter_id = adapter_id

    def replace(self, owner: Any, name: str, replacement: Any) -> Any:
        return self.patcher.replace(self.adapter_id, owner, name, replacement)

    def add(self, owner: Any, name: str, value: Any) -> None:
        self.patcher.add(self.adapter_id, owner, name, value)

    def add_item(self, mapping: MutableMapping[str, Any], mapping_name: str, key: str, value: Any) -> None:
        self.patcher.add_item(self.adapter_id, mapping, mapping_name, key, value)

    def on_revert(self, description: str, undo: Callable[[], None]) -> None:
        self.patcher.on_revert(self.adapter_id, description, undo)


def name_is_set(owner: Any, name: str) -> bool:
    return name in vars(owner)
