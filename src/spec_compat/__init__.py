"""spec_compat: run speculators' untouched VllmHiddenStatesGenerator on any vLLM.

import spec_compat; spec_compat.apply()
from speculators.data_generation import VllmHiddenStatesGenerator

The package face only re-exports: the apply engine is ``engine.py``, the adapters ``adapters/``.
"""

from __future__ import annotations

# Public without being in __all__ (as before the engine moved out): what the launcher, plugin and
# conversations call, and the types of a Report's fields.
from .detect import Environment as Environment
from .engine import VERSION, AdapterDecision, Report, apply, plan, revert
from .engine import apply_before_import as apply_before_import
from .engine import apply_in_worker as apply_in_worker
from .errors import EngineStopped, IncompatibleError, ResultContractError, SpecCompatError, WorkerError, WorkerTimeout
from .options import Options as Options
from .preflight import Finding as Finding
from .timing import reset_timings, timings

__version__ = VERSION
__all__ = [
    "AdapterDecision",
    "EngineStopped",
    "IncompatibleError",
    "Report",
    "ResultContractError",
    "SpecCompatError",
    "WorkerError",
    "WorkerTimeout",
    "apply",
    "plan",
    "reset_timings",
    "revert",
    "timings",
]
