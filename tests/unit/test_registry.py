"""The registry's records: every id a patch is recorded under is one of them, and each record's
speculators range is honoured by apply() (an adapter outside it does not apply, and says why)."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import spec_compat
from spec_compat.adapters.probe import Probe
from spec_compat.detect import detect
from spec_compat.options import Context, Options
from spec_compat.patching import Patcher
from spec_compat.registry import ADAPTERS, BY_ID, SUPPORTED_SPECULATORS, Adapter, AdapterOrderError, ordered
from spec_compat.versions import parse_version

ADAPTERS_DIR = Path(spec_compat.__file__).resolve().parent / "adapters"
# Where the adapter id a patch is recorded under stands: patcher.<method>(id, ...),
# <helper>(ctx, patcher, id, ...) and switch_on(id, ...).
PATCHER_METHODS = {"replace", "add", "add_item", "on_revert"}
ID_POSITIONS = {"set_flag": 2, "wrap_method": 2, "wrap_generate": 2, "install_call_adapter": 2, "switch_on": 0}
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


def _recorded_ids(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "patcher" and name in PATCHER_METHODS:
            position = 0
        elif name in ID_POSITIONS:
            position = ID_POSITIONS[name]
        else:
            continue
        if len(node.args) <= position:
            continue
        arg = node.args[position]
        if isinstance(arg, ast.Constant):
            found.append((node.lineno, arg.value))
        elif isinstance(arg, ast.Name) and arg.id in constants:
            found.append((node.lineno, constants[arg.id]))
    return found


def test_every_patch_id_in_the_adapters_is_a_registry_id() -> None:
    recorded = {
        f"{path.name}:{line}": adapter_id
        for path in ADAPTERS_DIR.glob("*.py")
        for line, adapter_id in _recorded_ids(path)
    }
    assert len(recorded) > 30  # the scanner sees the adapters' patches
    assert {where: adapter_id for where, adapter_id in recorded.items() if adapter_id not in BY_ID} == {}


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

    def apply(ctx: Context, patcher: Patcher) -> None:
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
    spec_compat._run_side(Context(env=env, options=Options()), "driver", report, Patcher())
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
