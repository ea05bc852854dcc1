"""vLLM ``vllm.general_plugins`` entry point: runs in every vLLM process that loads plugins.

It does nothing unless spec_compat's executor is starting this worker (the options are then in
the environment), so other vLLM engines are never touched.
"""

from __future__ import annotations

import logging
import os

from .options import WORKER_ENV

logger = logging.getLogger("spec_compat")


def load() -> None:
    options_json = os.environ.get(WORKER_ENV)
    if not options_json:
        return
    from .engine import apply_in_worker

    report = apply_in_worker(options_json)
    logger.debug("spec_compat worker adapters: %s", report.applied)
