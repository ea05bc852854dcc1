"""Make speculators' worker log lines visible, with the TP rank, inside vLLM worker processes.

vLLM configures only its own ``vllm`` logger in a worker; ``speculators.*`` loggers have no handler
there, so their INFO lines go to Python's last-resort handler (WARNING and up) and vanish.
"""

from __future__ import annotations

import logging
import sys

LOGGERS = ("speculators", "spec_compat")
_MARK = "spec_compat_worker_handler"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from .adapters.support import tp_rank

        rank = tp_rank()
        record.tp_rank = "?" if rank is None else str(rank)
        return True


def show_worker_logs(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_MARK)
    handler.setFormatter(logging.Formatter("[spec_compat TP%(tp_rank)s] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RankFilter())
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if any(h.get_name() == _MARK for h in logger.handlers):
            continue
        logger.addHandler(handler)
        logger.setLevel(level.upper())
