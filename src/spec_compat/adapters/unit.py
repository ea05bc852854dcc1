"""What one adapter is: its record (id, side, speculators range, why, vLLM change, detect, delete
when), its feature probe and its apply, in one value.

Every adapter module defines its units beside the probe and apply they name; ``registry.py`` is
the ordered list of those units. This module sits in adapters/ (not beside the registry) because
the adapter modules define units and must not import upward (tests/test_boundary.py).

``side``:
``import``: before speculators is imported (driver and every worker);
``worker``: speculators' worker module, in the driver (fork) and in every worker (plugin);
``worker-process``: vLLM's worker classes, only inside workers started by spec_compat's executor;
``driver``: speculators' generator module, in the driver only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..options import Context
from ..patching import AdapterPatcher, Patcher
from ..versions import ParsedVersion
from .probe import Probe

Side = Literal["import", "worker", "worker-process", "driver"]
# The default range: every release from the oldest supported one (the feature probe decides there).
SUPPORTED_SPECULATORS = SpecifierSet(">=0.3.0")
# The ranges of adapters for one speculators line's code (a pre-release counts as the release it
# leads to: speculators_excludes): 0.3.0's (deleted with its support), 0.4.x's.
SPECULATORS_0_3_ONLY = SpecifierSet("<0.4")
SPECULATORS_0_4_ONLY = SpecifierSet(">=0.4,<0.5")


@dataclass(frozen=True)
class Adapter:
    id: str
    side: Side
    patches: str
    why: str
    vllm_change: str  # first release that needs it, and the upstream change when known
    detect: str
    delete_when: str
    probe: Callable[[Context], Probe]
    apply: Callable[[Context, AdapterPatcher], None]  # given patcher.scoped(id): every patch carries this id
    # speculators releases whose code needs it: outside it the adapter is not applied (apply() says why)
    speculators: SpecifierSet = SUPPORTED_SPECULATORS
    # Ids of adapters on the same side that must be applied before / after this one. Where two
    # adapters wrap the same method, the one applied later wraps the earlier one (it runs outside
    # it), so these say which wrapper sees the other's arguments and results; the registry sorts by
    # them and refuses a list that cannot satisfy them (registry.ordered).
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

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
