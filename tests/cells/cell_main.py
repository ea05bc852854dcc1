"""Entry point shared by the engine cell scripts: any failure prints its traceback and exits 3."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable


def run(main: Callable[[], None]) -> None:
    try:
        main()
    except BaseException:  # noqa: BLE001 - report anything, exit non-zero
        traceback.print_exc()
        sys.exit(3)
