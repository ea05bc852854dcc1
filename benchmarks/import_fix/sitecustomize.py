"""Only the transformers import fix, in every process (driver and spawned vLLM workers).

Used by the unshimmed baseline of ``benchmarks/run.py`` (section "fail"): with every spec_compat
adapter disabled, the vLLM workers would die importing speculators (transformers 5 annotates
``PretrainedConfig.dtype`` with ``torch`` imported only under TYPE_CHECKING), long before the
break being measured. This is what spec_compat's ``transformers-torch-annotation`` adapter does;
it is put on PYTHONPATH for that cell only.
"""

from __future__ import annotations

import os

if os.environ.get("SPEC_COMPAT_BENCH_IMPORT_FIX") == "1":
    import torch
    import transformers.configuration_utils as configuration_utils

    if "torch" not in vars(configuration_utils):
        configuration_utils.torch = torch  # type: ignore[attr-defined]
