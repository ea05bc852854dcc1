"""``spec-compat run``'s start-up hook (see ``spec_compat.launcher``): do not import this by hand.

The launcher prepends this directory to ``PYTHONPATH``, so every Python process of the launched
command tree runs this file at start-up (``site`` imports ``sitecustomize``), before its
``__main__`` is imported: the launched command itself, its Python subprocesses, and the processes
multiprocessing spawns (vLLM's TP workers among them), which re-import the caller's ``__main__``.

Why the finder lives here and not in ``spec_compat.launcher``: every Python child pays for what
this file does, and ``import spec_compat`` alone takes ~60 ms (``importlib.metadata``,
``dataclasses``); a ``pip`` or ``python -c`` child must not. So this file only

* does nothing at all (beyond chaining, below) unless ``SPEC_COMPAT_RUN`` is set (the launcher
  sets it; a child started with that variable removed is untouched);
* puts one tiny finder first on ``sys.meta_path`` that compares each imported name with
  ``"speculators"`` and, on speculators' first import, hands over to ``spec_compat.launcher``
  (which applies the import-side adapters before speculators' first line runs);
* then runs the next ``sitecustomize`` on ``sys.path`` (the user's, or the distribution's), which
  this file shadows; like ``site``, an error there prints one line and start-up goes on.

A failure of the hook itself (spec_compat not importable by this interpreter, an adapter raising)
is one line on stderr, never a dead child; only in the launched process itself
(``spec_compat.launcher.is_launched_process``) does a failed apply() raise.
"""

from __future__ import annotations

import os
import sys

RUN_ENV = "SPEC_COMPAT_RUN"  # keep equal to spec_compat.launcher.RUN_ENV
TRIGGER = "speculators"
_HERE = os.path.dirname(os.path.abspath(__file__))
# Nothing heavier than os and sys at start-up (typing alone would double `python -c pass`).


def _say(message: str) -> None:
    try:  # noqa: SIM105 - contextlib would cost start-up time in every Python child
        sys.stderr.write(f"spec_compat run: {message}\n")
    except Exception:  # noqa: BLE001 - no usable stderr (None, closed): stay silent
        pass


class SpeculatorsImportHook:
    """First on ``sys.meta_path``: sees ``import speculators`` before any other finder does."""

    def __init__(self) -> None:
        self.fired = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname != TRIGGER or self.fired:
            return None
        self.fired = True  # once, and not re-entered by the imports the adapters make
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from spec_compat import launcher
        except Exception as exc:  # noqa: BLE001 - an unrelated child must keep working
            _say(f"hook inactive in {sys.executable} (pid {os.getpid()}): cannot import spec_compat: {exc}")
            return None
        launcher.before_speculators_import()
        return None  # the regular finders import speculators, now that the adapters are in place

    def invalidate_caches(self) -> None:
        return None


def _run_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows: the first one on ``sys.path`` after this directory."""
    import importlib.machinery

    here = os.path.realpath(_HERE)
    entries = list(sys.path)
    positions = [i for i, entry in enumerate(entries) if os.path.realpath(entry or os.curdir) == here]
    later = entries[positions[-1] + 1 :] if positions else entries
    later = [entry for entry in later if os.path.realpath(entry or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
        if spec is None or spec.loader is None:
            return
        import importlib.util  # only now: it costs more than the rest of this file

        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - what site.execsitecustomize does: report, go on
        _say(f"error in the next sitecustomize ({type(exc).__name__}: {exc}); start-up continues")


def _install() -> None:
    if os.environ.get(RUN_ENV):
        sys.meta_path.insert(0, SpeculatorsImportHook())  # type: ignore[arg-type]
    _run_next_sitecustomize()


_install()
