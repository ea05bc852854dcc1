"""What one adapter is: its record (id, side, speculators range, and its notes: why, the vLLM change,
how it is detected, when it can be deleted, what it patches), its feature probe and its apply, in one
value.

Every adapter module defines its units beside the probe and apply they name; ``registry.py`` is
the ordered list of those units. This module sits in adapters/ (not beside the registry) because
the adapter modules define units and must not import upward (tests/test_boundary.py).

``side``: when and where an adapter is applied (``SIDES``).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..options import Context
from ..patching import AdapterPatcher, Patcher
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


# The notes every record carries, in the order they are written: "<key>: <text>", a longer text
# continued on more-indented lines (joined with single spaces).
NOTE_KEYS = ("why", "vllm change", "detect", "delete when", "patches")
_NOTE_LINE = re.compile(r"^(?P<key>[a-z][a-z ]*): (?P<text>.*)$")


def parse_notes(notes: str) -> dict[str, str]:
    """The five notes of a record (``NOTE_KEYS``), each exactly once; anything else raises ValueError."""
    parsed: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in textwrap.dedent(notes).strip("\n").splitlines():
        if line.startswith((" ", "\t")):
            if current is None:
                raise ValueError(f"a continued line before any note: {line.strip()!r}")
            current.append(line.strip())
            continue
        match = _NOTE_LINE.match(line)
        if match is None or match["key"] not in NOTE_KEYS:
            raise ValueError(f"not a note ({', '.join(NOTE_KEYS)}): {line!r}")
        if match["key"] in parsed:
            raise ValueError(f"note {match['key']!r} written twice")
        current = parsed[match["key"]] = [match["text"].strip()]
    missing = [key for key in NOTE_KEYS if key not in parsed]
    if missing:
        raise ValueError(f"notes missing: {', '.join(missing)}")
    return {key: " ".join(parsed[key]) for key in NOTE_KEYS}


@dataclass(frozen=True)
class Adapter:
    id: str
    side: Side
    # patches / why / vllm change (first release that needs it, and the upstream change when known) /
    # detect / delete when, parsed by parse_notes into the fields of the same names below
    notes: str
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
    patches: str = field(init=False)
    why: str = field(init=False)
    vllm_change: str = field(init=False)
    detect: str = field(init=False)
    delete_when: str = field(init=False)

    def __post_init__(self) -> None:
        try:
            parsed = parse_notes(self.notes)
        except ValueError as exc:
            raise ValueError(f"adapter {self.id}: {exc}") from None
        for key, text in parsed.items():
            object.__setattr__(self, key.replace(" ", "_"), text)

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
