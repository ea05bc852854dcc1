"""The registry's records: every id a patch is recorded under is one of them, and each record's
speculators range is honoured by apply() (an adapter outside it does not apply, and says why)."""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet

import spec_compat.engine
from spec_compat.adapters.probe import Probe
from spec_compat.adapters.unit import PATCH_TARGET, TEXT_FIELDS, covers
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import AdapterPatcher, Patch, Patcher
from spec_compat.registry import (
    ADAPTERS,
    BY_ID,
    SIDE_FOLDERS,
    SUPPORTED_SPECULATORS,
    Adapter,
    AdapterOrderError,
    adapter_file,
    ordered,
)
from spec_compat.versions import parse_version

ADAPTERS_DIR = Path(spec_compat.__file__).resolve().parent / "adapters"
PATCHER_METHODS = {"replace", "add", "add_item", "on_revert"}
# The generate() wrappers, innermost first (the order speculators' generate is wrapped in).
GENERATE_WRAPPERS = (
    "single-step-batches",
    "sequence-limit",
    "input-order",
    "layer-ids",
    "results-contract",
    "input-validation",
    "generate-signal-shutdown",
)


def test_no_adapter_names_the_id_it_patches_under() -> None:
    """Adapters get ``patcher.scoped(id)`` (Adapter.install): a patch carries the id of the adapter
    whose apply made it, so no apply body or helper writes an id (one that could drift from the
    registry's). The check: no call of a patcher method in adapters/ starts with a string."""
    written = []
    for path in ADAPTERS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr in PATCHER_METHODS and "patcher" in ast.unparse(node.func.value):
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    written.append(f"{path.name}:{node.lineno}")
    assert written == []


def _module_adapters() -> dict[str, list[Adapter]]:
    """Every module under adapters/ -> the Adapter records bound at its top level."""
    found: dict[str, list[Adapter]] = {}
    for path in sorted(ADAPTERS_DIR.rglob("*.py")):
        relative = path.relative_to(ADAPTERS_DIR.parent).with_suffix("")
        module = importlib.import_module(".".join(("spec_compat", *relative.parts)).removesuffix(".__init__"))
        found[str(path.relative_to(ADAPTERS_DIR.parent))] = [v for v in vars(module).values() if isinstance(v, Adapter)]
    return found


def test_every_adapter_id_names_its_file() -> None:
    """An id (what doctor prints) is enough to find its adapter: adapters/<side folder>/<id, "-" as
    "_">.py defines that record and no other, and no other file in adapters/ defines a record."""
    by_file = _module_adapters()
    for adapter in ADAPTERS:
        path = adapter_file(adapter.id)
        assert path.rpartition("/")[2] == adapter.id.replace("-", "_") + ".py"
        assert path.removeprefix("adapters/").rpartition("/")[0] in SIDE_FOLDERS[adapter.side], adapter.id
        assert [a.id for a in by_file.get(path, [])] == [adapter.id], path
        assert by_file[path][0] is adapter, path
    defining = {path for path, records in by_file.items() if records}
    assert defining == {adapter_file(adapter.id) for adapter in ADAPTERS}
    assert len(ADAPTERS) == len(defining)


def _patching_adapter(adapter_id: str, target: type) -> Adapter:
    def apply(ctx: Context, patcher: AdapterPatcher) -> None:
        patcher.replace(target, "value", adapter_id)
        patcher.add(target, f"alias_{adapter_id.replace('-', '_')}", adapter_id)
        patcher.on_revert(f"undo {adapter_id}", lambda: None)

    return replace(BY_ID["layer-ids"], id=adapter_id, side="driver", probe=lambda ctx: Probe(True, "yes"), apply=apply)


def test_every_patch_carries_the_id_of_the_adapter_that_made_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import spec_compat.registry as registry

    class Target:
        value = "original"

    monkeypatch.setattr(registry, "ADAPTERS", (_patching_adapter("first", Target), _patching_adapter("second", Target)))
    patcher = Patcher()
    report = spec_compat.Report(env=detect(), options=Options())
    spec_compat.engine.run_side(Context(env=detect(), options=Options()), "driver", report, patcher)
    assert [(p.adapter_id, p.target) for p in patcher.patches] == [
        ("first", "Target.value"),
        ("first", "Target.alias_first"),
        ("first", "undo first"),
        ("second", "Target.value"),
        ("second", "Target.alias_second"),
        ("second", "undo second"),
    ]
    assert Target.value == "second"
    patcher.revert()
    assert Target.value == "original" and not hasattr(Target, "alias_first")


class _FakeMultiprocExecutor:
    pass


def test_the_executor_subclass_is_recorded_under_the_adapter_that_installed_it() -> None:
    """``executor`` installs the subclass the switch adapters set; with ``executor`` disabled, the
    first switch adapter installs it, and the report names that adapter, not a disabled one."""
    module = ModuleType("fake_vllm_hidden_states_generator")
    module.MultiprocExecutor = _FakeMultiprocExecutor  # type: ignore[attr-defined]
    ctx = Context(env=detect(), options=Options(), generator=module)
    patcher = Patcher()
    BY_ID["executor-reply-shape"].install(ctx, patcher)
    assert [(p.adapter_id, p.name) for p in patcher.patches] == [
        ("executor-reply-shape", "MultiprocExecutor"),
        ("executor-reply-shape", "hooks"),
    ]
    patcher.revert()
    assert module.MultiprocExecutor is _FakeMultiprocExecutor
    BY_ID["executor"].install(ctx, patcher)
    BY_ID["executor-reply-shape"].install(ctx, patcher)
    assert [(p.adapter_id, p.name) for p in patcher.patches] == [
        ("executor", "MultiprocExecutor"),
        ("executor", "hooks"),
        ("executor-reply-shape", "hooks"),
    ]
    patcher.revert()


def test_ranges_are_specifier_sets() -> None:
    assert all(isinstance(adapter.speculators, SpecifierSet) for adapter in ADAPTERS)
    assert str(BY_ID["capture-gate"].speculators) == "<0.4"
    assert BY_ID["input-order"].speculators == SpecifierSet(">=0.4,<0.5")
    assert BY_ID["layer-ids"].speculators == SUPPORTED_SPECULATORS


@pytest.mark.parametrize(
    ("installed", "excluded"),
    [
        ("0.3.0", False),
        ("0.4.0.1", True),
        ("0.4.0rc1", True),  # a pre-release carries the code of the release it leads to
        ("0.3.1.dev4", False),
        ("0.1.dev12+g1a2b3c4", False),  # a source checkout: the probe decides
        ("not-a-version", False),
    ],
)
def test_range_check(installed: str, excluded: bool) -> None:
    reason = BY_ID["capture-gate"].speculators_excludes(parse_version(installed))
    assert (reason is not None) is excluded
    if excluded:
        assert reason == f"speculators {installed} is outside this adapter's range <0.4"


def _fake_adapter(adapter_id: str, speculators: SpecifierSet, calls: list[str]) -> Adapter:
    def probe(ctx: Context) -> Probe:
        calls.append(f"probe {adapter_id}")
        return Probe(True, "applies")

    def apply(ctx: Context, patcher: AdapterPatcher) -> None:
        calls.append(f"apply {adapter_id}")

    template = BY_ID["layer-ids"]
    return replace(template, id=adapter_id, side="driver", probe=probe, apply=apply, speculators=speculators)


def test_apply_honours_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import spec_compat.registry as registry

    calls: list[str] = []
    fakes = (
        _fake_adapter("old-only", SpecifierSet("<0.4"), calls),
        _fake_adapter("new-only", SpecifierSet(">=0.4,<0.5"), calls),
        _fake_adapter("any", SUPPORTED_SPECULATORS, calls),
    )
    monkeypatch.setattr(registry, "ADAPTERS", fakes)
    env = replace(detect(), speculators=parse_version("0.4.0.1"))
    report = spec_compat.Report(env=env, options=Options())
    spec_compat.engine.run_side(Context(env=env, options=Options()), "driver", report, Patcher())
    decisions = {d.id: d for d in report.decisions}
    assert calls == ["probe new-only", "apply new-only", "probe any", "apply any"]  # never probed outside
    assert not decisions["old-only"].applies and not decisions["old-only"].blocking
    assert decisions["old-only"].reason == "speculators 0.4.0.1 is outside this adapter's range <0.4"
    assert report.applied == ["new-only", "any"] and report.problems == []


# ---- order constraints (after= / before=) -------------------------------------------------------------------


def _unit(adapter_id: str, side: str = "driver", after: tuple[str, ...] = (), before: tuple[str, ...] = ()) -> Adapter:
    return replace(BY_ID["layer-ids"], id=adapter_id, side=side, after=after, before=before)  # type: ignore[arg-type]


def test_the_registry_satisfies_every_constraint() -> None:
    position = {adapter.id: k for k, adapter in enumerate(ADAPTERS)}
    for adapter in ADAPTERS:
        assert all(position[other] < position[adapter.id] for other in adapter.after), adapter.id
        assert all(position[other] > position[adapter.id] for other in adapter.before), adapter.id


def test_the_generate_wrappers_are_ordered_by_their_constraints_not_by_list_position() -> None:
    wrappers = [a for a in ADAPTERS if a.id in GENERATE_WRAPPERS]
    assert [a.id for a in ordered(reversed(wrappers))] == [a.id for a in wrappers] == list(GENERATE_WRAPPERS)


def test_a_list_out_of_order_is_sorted_and_otherwise_kept() -> None:
    units = [_unit("outer", after=("inner",)), _unit("free"), _unit("inner"), _unit("first", before=("free",))]
    assert [u.id for u in ordered(units)] == ["inner", "outer", "first", "free"]


@pytest.mark.parametrize(
    ("units", "message"),
    [
        ([_unit("a", after=("b",)), _unit("b", after=("a",))], "form a cycle: a after ['b'], b after ['a']"),
        ([_unit("a", before=("b",)), _unit("b", before=("a",))], "form a cycle"),
        ([_unit("a", after=("missing",))], "a: orders itself against unknown adapter 'missing'"),
        ([_unit("a", after=("b",)), _unit("b", side="worker")], "sides are applied at different times"),
        ([_unit("a"), _unit("a")], "adapter ids must be unique"),
    ],
)
def test_a_violated_constraint_is_caught(units: list[Adapter], message: str) -> None:
    with pytest.raises(AdapterOrderError, match=re.escape(message)):
        ordered(units)


def test_every_record_has_its_texts_and_patch_targets() -> None:
    for unit in ADAPTERS:
        assert all(getattr(unit, name).strip() for name in TEXT_FIELDS), unit.id
        assert unit.patches and all(PATCH_TARGET.match(target) for target in unit.patches), unit.id


def test_every_patch_target_is_under_a_package_the_adapters_patch() -> None:
    """Full dotted paths from the top-level package (what tests/cells/apply_checks.py resolves), not
    the short names a reader would have to complete."""
    roots = {"speculators", "vllm", "transformers", "sys", "os", "faulthandler", "spec_compat"}  # os: os.environ[X]
    assert {t.split(".")[0] for unit in ADAPTERS for t in unit.patches} <= roots


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"why": "  "}, "empty why"),
        ({"patches": ()}, "patches must be a non-empty tuple"),
        ({"patches": "module.name"}, "patches must be a non-empty tuple"),
        ({"patches": ("VllmHiddenStatesGenerator.generate (a note)",)}, "not a patch target"),
        ({"patches": ("generate",)}, "not a patch target"),
    ],
)
def test_a_malformed_record_is_refused_with_the_adapter_id(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"adapter layer-ids: {re.escape(message)}"):
        replace(BY_ID["layer-ids"], **changes)


class _Owner:
    method = None


@pytest.mark.parametrize(
    ("target", "patch", "covered"),
    [
        ("tests.unit.test_registry._Owner.method", Patch("x", _Owner, "method", None, None), True),
        ("tests.unit.test_registry._Owner.*", Patch("x", _Owner, "other", None, None), True),
        ("tests.unit.test_registry._Owner.method", Patch("x", _FakeMultiprocExecutor, "method", None, None), False),
        ("tests.unit.test_registry._Owner.other", Patch("x", _Owner, "method", None, None), False),
        ("sys.modules[transformers.*]", Patch("x", {}, "transformers.gone", None, None, item_of="sys.modules"), True),
        ("sys.modules[transformers.*]", Patch("x", {}, "torch.gone", None, None, item_of="sys.modules"), False),
        (
            "faulthandler.register()",
            Patch("x", None, "faulthandler.register(SIGUSR2, f)", None, None, undo=print),
            True,
        ),
        ("faulthandler.register()", Patch("x", None, "signal.signal(SIGINT)", None, None, undo=print), False),
    ],
)
def test_a_target_covers_the_patches_it_names(target: str, patch: Patch, covered: bool) -> None:
    assert covers(target, patch) is covered


def test_a_target_that_names_nothing_raises() -> None:
    with pytest.raises(AttributeError):
        covers("tests.unit.test_registry._Missing.method", Patch("x", _Owner, "method", None, None))
