"""Build the offline bundle that provisions the official CUDA vLLM on the lent GPU machine.

The device machine (Python 3.12, torch 2.11.0+cu130 preinstalled) has no network, and each call
carries at most 64 MiB. This script, run here (internet only to PyPI), downloads for cp312 /
manylinux x86_64:

* the official ``vllm==0.22.1`` wheel (it pins ``torch==2.11.0``, the device's torch), with what
  the run does not need taken out: the FlashAttention-2 build (FA3 is what Hopper uses), the
  ``vllm-rs`` binary and the other Pythons' DeepGEMM builds;
* the dependency wheels the device image lacks (``DEPENDENCIES``; checked against vLLM's and each
  other's ``Requires-Dist`` and the device's package list, see ``closure_report``);
* ``speculators==0.4.0.1`` and ``speculators==0.3.0`` (installed there ``--no-deps`` into two
  separate ``--target`` folders).

Every wheel is rewritten with its members stored uncompressed (pip does not care), the lot is put
in one tar compressed with xz (FA3's kernels shrink from 37 MiB deflated to about 10 MiB in xz's
large window) and the result is cut into parts of at most ``--part-mib`` MiB, each with its sha256
in ``manifest.json`` and ``SHA256SUMS``. Downloads and rewritten wheels are cached, so a rerun is
fast. ``--stage`` copies part i into ``<repo>/build/gpu_parts/p<i>/`` (ignored by git), so that
each device call carries one part (``carry: ["build/gpu_parts/p<i>"]``); ``tools/gpu_install.sh``
joins, verifies and installs them there.

A *release bundle* (``--release VERSION``, see ``RELEASES``) lets the same device session run
another vLLM release on top of that install: it carries only that release's vLLM wheel (stripped
the same way) and the few dependency wheels whose required versions differ from what the 0.22.1
bundle carries or the device image has; its closure is checked against (release) plus (0.22.1
bundle) plus (device image). Staged into ``build/gpu_parts/r<VERSION>/`` (or ``r<VERSION>a/``,
``r<VERSION>b/``, ... when it needs more than one call), installed there by
``tools/gpu_install.sh --release VERSION`` into its own ``--target`` folder that goes first on
``PYTHONPATH``.

    python tools/gpu_bundle.py            # build (or reuse) the bundle, print the parts
    python tools/gpu_bundle.py --stage    # ... and stage the parts into build/gpu_parts/p<i>/
    python tools/gpu_bundle.py --release 0.23.0 --stage   # a release bundle -> build/gpu_parts/r0.23.0/
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from shared_constants import TESTED_SPECULATORS

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path.home() / ".cache" / "spec_compat" / "gpu_bundle"
DEFAULT_CACHE = Path.home() / ".cache" / "spec_compat" / "gpu_bundle_dl"
STAGE_DIR = REPO / "build" / "gpu_parts"  # ignored by .gitignore ("build/")
BUNDLE_NAME = "sc_bundle.tar.xz"
FORMAT = 1
MIB = 1 << 20
DEVICE_CARRY_LIMIT_MIB = 64

VLLM = "vllm==0.22.1"
SPECULATORS = TESTED_SPECULATORS

# Wheels the device image lacks (names as PyPI spells them). The set a run of vLLM 0.22.1's
# LLM on this device image was seen to need (shared reference GPU_NOTES.md), pinned to the
# versions that worked. Traps: openai / anthropic import httpx2 (+ httpcore2, truststore);
# xgrammar 0.2.9 needs apache-tvm-ffi >= 0.1.11 although vLLM pins 0.1.9 for other packages;
# fastapi needs opentelemetry-api.
DEPENDENCIES: tuple[str, ...] = (
    "annotated-types==0.8.0",
    "anthropic==2.14.0",
    "apache-tvm-ffi==0.1.15",
    "astor==0.8.1",
    "blake3==1.0.11",
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "compressed-tensors==0.15.0.1",
    "depyf==0.20.0",
    "dill==0.4.1",
    "diskcache==5.6.3",
    "distro==1.9.0",
    "dnspython==2.9.2",
    "docstring-parser==0.18.0",
    "email-validator==2.4.0",
    "fastapi==0.165.0",
    "gguf==0.19.0",
    "httpcore2==2.16.2",
    "httptools==0.9.0",
    "httpx2==2.16.2",
    "ijson==3.6.0",
    "interegular==0.3.3",
    "jiter==0.19.0",
    "jmespath==1.1.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "lark==1.2.2",
    "llguidance==1.7.6",
    "lm-format-enforcer==0.11.3",
    "loguru==0.7.3",
    "mcp==2.3.0",
    "mcp-types==2.3.0",
    "mistral-common==1.13.1",
    "model-hosting-container-standards==0.1.16",
    "msgspec==0.23.0",
    "openai==2.54.0",
    "openai-harmony==0.0.8",
    "opentelemetry-api==1.45.2",
    "outlines-core==0.2.14",
    "partial-json-parser==0.2.1.1.post7",
    "prometheus-fastapi-instrumentator==8.1.0",
    "pybase64==1.5.1",
    "pycountry==26.2.16",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pydantic-extra-types==2.11.1",
    "pyjwt==2.15.1",
    "python-json-logger==4.2.0",
    "python-multipart==0.0.34",
    "pyzmq==27.3.0",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "setproctitle==1.3.8",
    "sniffio==1.3.1",
    "sse-starlette==3.7.0",
    "starlette==1.10.0",
    "supervisor==4.3.0",
    "truststore==0.10.5",
    "typing-inspection==0.4.5",
    "uvicorn==0.54.0",
    "watchfiles==1.3.0",
    "websockets==17.4",
    "xgrammar==0.2.9",
)

# vLLM requirements deliberately not carried: optional CUDA kernel packages and telemetry
# exporters that vLLM 0.22.1 imports lazily (the run in GPU_NOTES.md went without them).
NOT_CARRIED: dict[str, str] = {
    "flashinfer-python": "optional kernels; VLLM_USE_FLASHINFER_SAMPLER=0 keeps the sampler off it",
    "flashinfer-cubin": "optional kernels (flashinfer)",
    "tilelang": "optional kernels",
    "nvidia-cudnn-frontend": "optional kernels",
    "fastsafetensors": "optional loader",
    "nvidia-cutlass-dsl": "optional kernels",
    "quack-kernels": "optional kernels",
    "tokenspeed-mla": "optional kernels",
    "humming-kernels": "imported by vLLM 0.22.1's quantization registry for any quantized checkpoint: carried "
    "beside the bundle in build/gpu_extra/ with pyelftools (tools/GPU.md, quantized cells)",
    "opentelemetry-sdk": "tracing, imported only when OTLP tracing is configured",
    "opentelemetry-exporter-otlp": "tracing, imported only when OTLP tracing is configured",
    "opentelemetry-semantic-conventions-ai": "tracing, imported only when OTLP tracing is configured",
}

# Version conflicts accepted on purpose (requirement of -> carried or device version).
ACCEPTED_CONFLICTS: dict[tuple[str, str], str] = {
    ("vllm", "apache-tvm-ffi"): "xgrammar 0.2.9 needs apache-tvm-ffi >= 0.1.11; 0.1.15 worked with vLLM 0.22.1",
    ("mistral-common", "numpy"): "the device's numpy 2.5.2 is newer than mistral-common's cap; only its tokenizers "
    "for Mistral models would use it",
}

# Release bundles: for each vLLM release, the wheels it needs besides the 0.22.1 bundle and the
# device image (names as PyPI spells them). All these releases pin torch==2.11.0 (the device's)
# and accept transformers 5.17.0. Why each is carried:
# * compressed-tensors: vLLM pins 0.17.0 (0.22.1 pinned 0.15.0.1, which the bundle carries);
# * fastapi: vLLM >= 0.23 wants fastapi[standard] < 0.137, the bundle carries 0.165.0;
# * humming-kernels + pyelftools: vLLM pins its humming version, and its quantization registry
#   imports humming for any quantized checkpoint (for 0.22.1 they ride in build/gpu_extra/).
_RELEASE_COMMON = ("compressed-tensors==0.17.0", "fastapi==0.136.3", "pyelftools==0.33")
RELEASES: dict[str, tuple[str, ...]] = {
    "0.23.0": (*_RELEASE_COMMON, "humming-kernels==0.1.4"),
    "0.24.0": (*_RELEASE_COMMON, "humming-kernels==0.1.6"),
    "0.25.1": (*_RELEASE_COMMON, "humming-kernels==0.1.10"),
    "0.26.0": (*_RELEASE_COMMON, "humming-kernels==0.1.10"),
}

# Requirements of the newer releases left out on purpose, on top of NOT_CARRIED (read in their
# sources: each is imported lazily or behind a guard).
RELEASE_NOT_CARRIED: dict[str, str] = {
    "torchcodec": "video decoding only; vllm.multimodal.video imports it in try/except (vLLM >= 0.25)",
    "pynvvideocodec": "GPU video decoding only, imported inside the pynvvideocodec backend (vLLM >= 0.25)",
    "nvtx": "imported only when VLLM_NVTX_SCOPES_FOR_PROFILING is set (vLLM >= 0.25)",
}

# Parts of a release bundle: at most this many MiB each, so one call carries a part plus the
# working tree (0.3 to 4 MiB) under DEVICE_CARRY_LIMIT_MIB.
RELEASE_PART_MIB = 62.0

# The device image ('cuda', KINDS.md of the device tool, read 2026-11-17) and the versions known
# from its pip list. Carry one of these only for another version.
DEVICE_VERSIONS: dict[str, str] = {
    "python": "3.12.3",
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchaudio": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
_DEVICE_IMAGE = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
    opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp"""
DEVICE_PACKAGES = frozenset(canonicalize_name(n) for n in _DEVICE_IMAGE.split())

# Markers are evaluated for the device's interpreter.
DEVICE_MARKERS: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)

# Members of the vLLM wheel that the run does not need (GPU_NOTES.md). FA3 stays: the model
# registry imports vllm_flash_attn while inspecting any model, and Hopper runs FA3.
_VLLM_DROP = re.compile(
    r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"
    r"|^vllm/vllm-rs$"
    r"|^vllm/third_party/deep_gemm/_C\.cpython-(?!312-)\d+-x86_64-linux-gnu\.so$"
)


def vllm_drop(member: str) -> bool:
    return _VLLM_DROP.match(member) is not None


def keep_all(member: str) -> bool:
    return False


def log(message: str) -> None:
    print(f"[gpu_bundle] {message}", flush=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def pin(spec: str) -> tuple[str, str]:
    """``name==version`` -> (canonical name, version)."""
    req = Requirement(spec)
    versions = [s.version for s in req.specifier if s.operator == "=="]
    if len(versions) != 1:
        raise ValueError(f"{spec!r}: pin one exact version")
    return canonicalize_name(req.name), versions[0]


def find_wheel(folder: Path, name: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.whl")):
        wheel_name, wheel_version, _, _ = parse_wheel_filename(path.name)
        if wheel_name == name and wheel_version == Version(version):
            return path
    return None


def pip_download(specs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp", "--disable-pip-version-check", "-q", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    log(f"pip download {' '.join(specs)}")
    subprocess.run([*cmd, *specs], check=True)


def download(specs: Iterable[str], dest: Path) -> dict[str, Path]:
    """Pinned wheels from the cache, downloading the missing ones (one pip call per name clash)."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = list(specs)
    missing = [s for s in specs if find_wheel(dest, *pin(s)) is None]
    batches: list[list[str]] = []
    for spec in missing:  # pip refuses two versions of one name in one call
        batch = next((b for b in batches if pin(spec)[0] not in {pin(s)[0] for s in b}), None)
        if batch is None:
            batches.append([spec])
        else:
            batch.append(spec)
    for batch in batches:
        pip_download(batch, dest)
    found: dict[str, Path] = {}
    for spec in specs:
        path = find_wheel(dest, *pin(spec))
        if path is None:
            raise SystemExit(f"pip saved no wheel for {spec} in {dest}")
        found[spec] = path
    return found


def restore_wheel(source: Path, target: Path, drop: Callable[[str], bool]) -> list[str]:
    """Copy a wheel with every member stored uncompressed (so xz sees the raw bytes), leaving out
    the members ``drop`` selects and their RECORD lines. Cached: reused when newer than ``source``."""
    dropped: list[str] = []
    with zipfile.ZipFile(source) as zin:
        dropped = [i.filename for i in zin.infolist() if drop(i.filename)]
        if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
            return dropped
        tmp = target.with_name(target.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zout:
            for info in zin.infolist():
                if info.filename in dropped:
                    continue
                out_info = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out_info.external_attr = info.external_attr
                out_info.compress_type = zipfile.ZIP_STORED
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = zin.read(info).decode().splitlines(keepends=True)
                    kept = [line for line in lines if line.split(",", 1)[0] not in dropped]
                    zout.writestr(out_info, "".join(kept))
                    continue
                out_info.file_size = info.file_size
                with zin.open(info) as src, zout.open(out_info, "w", force_zip64=info.file_size > 1 << 31) as dst:
                    shutil.copyfileobj(src, dst, 4 * MIB)
    tmp.replace(target)
    return dropped


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of a wheel."""
    name, version, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as zf:
        meta_name = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = zf.read(meta_name).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    requires = [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]
    return name, str(version), requires


@dataclass
class Closure:
    missing: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)
    assumed_on_device: list[str] = field(default_factory=list)
    shadows_device: list[str] = field(default_factory=list)
    shadows_base: list[str] = field(default_factory=list)
    extras_unmet: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.conflicts

    def as_dict(self) -> dict[str, Any]:
        return {k: sorted(set(v)) for k, v in self.__dict__.items()} | {"ok": self.ok}


def _applies(req: Requirement, extra: str) -> bool:
    if req.marker is None:
        return not extra
    env = dict(DEVICE_MARKERS, extra=extra)
    return Marker(str(req.marker)).evaluate(env)


def closure_report(
    wheels: list[Path],
    spec_wheels: list[Path],
    base: list[Path] | None = None,
    not_carried: dict[str, str] | None = None,
) -> Closure:
    """Check every Requires-Dist of the carried wheels against the carried set plus the device
    image: what is missing, what conflicts, what is assumed to be on the device.

    For a release bundle, ``base`` holds the 0.22.1 bundle's wheels: the run sees the release's
    wheels first, then the base's, so a base wheel of the same name is shadowed; the requirements
    of every wheel the run sees (the release's and the base's that stay visible) are checked."""
    not_carried = NOT_CARRIED if not_carried is None else not_carried
    carried: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    own: set[str] = set()
    for path in wheels:
        name, version, reqs = wheel_metadata(path)
        carried[name] = version
        requires[name] = reqs
        own.add(name)
    result = Closure()
    for path in base or []:
        name, version, reqs = wheel_metadata(path)
        if name in own:
            result.shadows_base.append(f"{name} {version} -> {carried[name]}")
            continue
        carried[name] = version
        requires[name] = reqs
    result.shadows_device = [n for n in own if n in DEVICE_PACKAGES]

    def check(owner: str, req: Requirement, soft: bool) -> None:
        name = canonicalize_name(req.name)
        label = f"{owner} -> {req}"
        if name in not_carried:
            result.not_carried.append(f"{label} ({not_carried[name]})")
            return
        have = carried.get(name) or DEVICE_VERSIONS.get(name)
        if have is None:
            if name in DEVICE_PACKAGES:
                result.assumed_on_device.append(label)
            else:
                (result.extras_unmet if soft else result.missing).append(label)
            return
        if SpecifierSet(str(req.specifier)).contains(have, prereleases=True):
            return
        where = "carried" if name in carried else "device"
        text = f"{label}: {where} {have}"
        if (owner, name) in ACCEPTED_CONFLICTS:
            result.accepted.append(f"{text} ({ACCEPTED_CONFLICTS[(owner, name)]})")
        else:
            (result.extras_unmet if soft else result.conflicts).append(text)

    for owner, reqs in requires.items():
        for line in reqs:
            req = Requirement(line)
            if not _applies(req, ""):
                continue
            check(owner, req, soft=False)
            target = canonicalize_name(req.name)
            for extra in sorted(req.extras):  # e.g. fastapi[standard]: reported, never fatal
                for extra_line in requires.get(target, []):
                    extra_req = Requirement(extra_line)
                    if extra_req.marker is not None and _applies(extra_req, extra) and not _applies(extra_req, ""):
                        check(f"{owner} ({target}[{extra}])", extra_req, soft=True)
    # speculators is installed --no-deps next to a newer torch / transformers on purpose; only
    # names it needs that are nowhere are reported.
    for path in spec_wheels:
        owner, version, reqs = wheel_metadata(path)
        for line in reqs:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if _applies(req, "") and name not in carried and name not in DEVICE_PACKAGES:
                result.extras_unmet.append(f"{owner}=={version} -> {req} (nowhere; imported only by other subpackages)")
    return result


def write_tar(sink: IO[bytes], members: list[tuple[str, Path]]) -> None:
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for arcname, path in sorted(members):
            info = tar.gettarinfo(str(path), arcname)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with path.open("rb") as handle:
                tar.addfile(info, handle)


def build_tar(members: list[tuple[str, Path]], target: Path, preset: int, threads: int) -> None:
    """Uncompressed tar (sorted, fixed owner and mtime) piped through xz (the CLI when present,
    for its threads; Python's lzma otherwise)."""
    tmp = target.with_name(target.name + ".tmp")
    xz = shutil.which("xz")
    started = time.perf_counter()
    with tmp.open("wb") as raw:
        if xz:
            proc = subprocess.Popen([xz, f"-{preset}", f"-T{threads}", "-c"], stdin=subprocess.PIPE, stdout=raw)
            assert proc.stdin is not None
            with proc.stdin as sink:
                write_tar(sink, members)
            if proc.wait() != 0:
                raise SystemExit(f"xz failed with exit code {proc.returncode}")
        else:
            with lzma.LZMAFile(raw, "wb", preset=preset) as sink:
                write_tar(sink, members)
    tmp.replace(target)
    log(f"compressed {target.name}: {target.stat().st_size / MIB:.1f} MiB in {time.perf_counter() - started:.0f} s")


def split(source: Path, out: Path, part_bytes: int) -> list[dict[str, Any]]:
    """Cut ``source`` into equal parts of at most ``part_bytes``."""
    size = source.stat().st_size
    count = max(1, math.ceil(size / part_bytes))
    each = math.ceil(size / count)
    parts = []
    with source.open("rb") as handle:
        for index in range(count):
            name = f"{source.name}.part{index:02d}"
            data = handle.read(each)
            (out / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def inputs_key(members: list[tuple[str, Path]], preset: int, part_bytes: int) -> str:
    digest = hashlib.sha256(f"{FORMAT}:{preset}:{part_bytes}".encode())
    for arcname, path in sorted(members):
        stat = path.stat()
        digest.update(f"{arcname}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def tree_bytes() -> int:
    """Bytes of what a device call sends besides carried paths: tracked and untracked-not-ignored files."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for rel in filter(None, listing.split(b"\0")):
        path = REPO / os.fsdecode(rel)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def stage_names(manifest: dict[str, Any]) -> list[str]:
    """Staged folder of each part: p<i> for the 0.22.1 bundle; r<VERSION> for a release bundle of
    one part, r<VERSION>a, r<VERSION>b, ... for one of several."""
    count = len(manifest["parts"])
    release = manifest.get("release")
    if release is None:
        return [f"p{i}" for i in range(count)]
    if count == 1:
        return [f"r{release}"]
    return [f"r{release}{chr(ord('a') + i)}" for i in range(count)]


def stage_clear(release: str | None) -> None:
    """Remove the staged folders of the same bundle only (p<i>/ or r<VERSION>[a-z]/), never the others."""
    if not STAGE_DIR.is_dir():
        return
    pattern = re.compile(r"^p\d+$" if release is None else rf"^r{re.escape(release)}[a-z]?$")
    for folder in STAGE_DIR.iterdir():
        if folder.is_dir() and pattern.match(folder.name):
            shutil.rmtree(folder)


def stage(out: Path, manifest: dict[str, Any]) -> list[Path]:
    """Copy part i (plus the manifest and checksums) into build/gpu_parts/<stage_names()[i]>/."""
    stage_clear(manifest.get("release"))
    tree = tree_bytes()
    folders = []
    for name_, part in zip(stage_names(manifest), manifest["parts"], strict=True):
        folder = STAGE_DIR / name_
        folder.mkdir(parents=True)
        for name in (part["name"], "manifest.json", "SHA256SUMS"):
            shutil.copy2(out / name, folder / name)
        carried = sum(p.stat().st_size for p in folder.iterdir())
        total = (tree + carried) / MIB
        verdict = "ok" if total <= DEVICE_CARRY_LIMIT_MIB else "OVER THE LIMIT"
        log(
            f"staged {folder.relative_to(REPO)}: carry {carried / MIB:.2f} MiB + tree {tree / MIB:.2f} MiB "
            f"= {total:.2f} MiB ({verdict}, limit {DEVICE_CARRY_LIMIT_MIB} MiB)"
        )
        folders.append(folder)
    return folders


def pack(
    out: Path,
    bundle_name: str,
    members: list[tuple[str, Path]],
    args: argparse.Namespace,
    part_mib: float,
    fields: dict[str, Any],
) -> dict[str, Any]:
    """Tar + xz ``members`` into ``out/bundle_name``, cut into parts of at most ``part_mib`` MiB, write
    manifest.json (``fields`` added) and SHA256SUMS; reuse the parts when the inputs are unchanged."""
    part_bytes = int(part_mib * MIB)
    key = inputs_key(members, args.xz_preset, part_bytes)
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and not args.force:
        old = json.loads(manifest_path.read_text())
        if old.get("inputs_key") == key and all(
            (out / p["name"]).is_file() and (out / p["name"]).stat().st_size == p["bytes"] for p in old["parts"]
        ):
            log(f"bundle up to date in {out}")
            return dict(old) | fields
    for stale in out.glob(f"{bundle_name}*"):
        stale.unlink()
    joined = out / bundle_name
    build_tar(members, joined, args.xz_preset, args.threads)
    parts = split(joined, out, part_bytes)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs_key": key,
        "joined": {"name": bundle_name, "bytes": joined.stat().st_size, "sha256": sha256_file(joined)},
        "parts": parts,
        "wheels": sorted(name for name, _ in members),
        "uncompressed_bytes": sum(p.stat().st_size for _, p in members),
        "xz_preset": args.xz_preset,
    } | fields
    if not args.keep_joined:
        joined.unlink()
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    sums = [f"{p['sha256']}  {p['name']}" for p in parts]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return manifest


def check_closure(closure: Closure, args: argparse.Namespace) -> dict[str, Any]:
    report = closure.as_dict()
    if not closure.ok:
        for key in ("missing", "conflicts"):
            for line in report[key]:
                log(f"{key}: {line}")
        if not args.allow_unmet:
            raise SystemExit("the carried set does not cover its own requirements (see above; --allow-unmet to go on)")
    return report


def build(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    cache: Path = args.cache
    wheels_dir, stored_dir = cache / "wheels", cache / "stored"
    stored_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    deps = [*DEPENDENCIES, *args.extra]
    downloaded = download([VLLM, *deps], wheels_dir)
    spec_wheels = download([f"speculators=={v}" for v in SPECULATORS], wheels_dir)

    members, carried, stripped = store_wheels(downloaded, VLLM, stored_dir)
    spec_members: list[Path] = []
    for version, (_, path) in zip(SPECULATORS, spec_wheels.items(), strict=True):
        target = stored_dir / path.name
        restore_wheel(path, target, keep_all)
        members.append((f"spec-{version}/{path.name}", target))
        spec_members.append(target)

    report = check_closure(closure_report(carried, spec_members), args)
    fields = {"vllm": VLLM, "speculators": list(SPECULATORS), "stripped_from_vllm": stripped, "closure": report}
    return pack(out, BUNDLE_NAME, members, args, args.part_mib, fields)


def store_wheels(
    downloaded: dict[str, Path], vllm_spec: str, stored_dir: Path
) -> tuple[list[tuple[str, Path]], list[Path], list[str]]:
    """Each downloaded wheel rewritten stored (the vLLM one stripped) into ``stored_dir``: the
    bundle members (``wheels/<name>``), the rewritten wheels, and what was stripped from vLLM."""
    members: list[tuple[str, Path]] = []
    carried: list[Path] = []
    stripped: list[str] = []
    for spec, path in downloaded.items():
        target = stored_dir / path.name
        dropped = restore_wheel(path, target, vllm_drop if spec == vllm_spec else keep_all)
        if spec == vllm_spec:
            stripped = dropped
        members.append((f"wheels/{path.name}", target))
        carried.append(target)
    return members, carried, stripped


def build_release(args: argparse.Namespace, version: str) -> dict[str, Any]:
    """The release bundle of ``vllm==version``: its stripped wheel plus RELEASES[version], closure
    checked over (release) + (the 0.22.1 bundle) + (device image); in ``<out>/r<version>/``."""
    if version not in RELEASES:
        raise SystemExit(f"no release bundle defined for vLLM {version} (RELEASES has {', '.join(RELEASES)})")
    out: Path = args.out / f"r{version}"
    wheels_dir, stored_dir = args.cache / "wheels", args.cache / "stored"
    stored_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    spec_vllm = f"vllm=={version}"
    downloaded = download([spec_vllm, *RELEASES[version], *args.extra], wheels_dir)
    base = download([VLLM, *DEPENDENCIES], wheels_dir)  # the 0.22.1 bundle's wheels (cached)

    members, carried, stripped = store_wheels(downloaded, spec_vllm, stored_dir)
    own = {wheel_metadata(p)[0] for p in carried}
    not_carried = {k: v for k, v in NOT_CARRIED.items() if k not in own} | RELEASE_NOT_CARRIED
    closure = closure_report(carried, [], base=list(base.values()), not_carried=not_carried)
    report = check_closure(closure, args)
    base_manifest = args.out / "manifest.json"
    base_sha = json.loads(base_manifest.read_text())["joined"]["sha256"] if base_manifest.is_file() else None
    fields = {
        "release": version,
        "vllm": spec_vllm,
        "carries": sorted(RELEASES[version]) + list(args.extra),
        "stripped_from_vllm": stripped,
        "base": {"vllm": VLLM, "joined_sha256": base_sha},
        "closure": report,
    }
    return pack(out, f"sc_release_{version}.tar.xz", members, args, args.release_part_mib, fields)


def summarize(manifest: dict[str, Any]) -> None:
    closure = manifest["closure"]
    log(
        f"{manifest['vllm']}: requirements ok={closure['ok']}; not carried on purpose: {len(closure['not_carried'])}; "
        f"accepted conflicts: {len(closure['accepted'])}; assumed on the device: {len(closure['assumed_on_device'])}"
    )
    for line in closure["accepted"]:
        log(f"  accepted: {line}")
    for line in closure["extras_unmet"]:
        log(f"  note: {line}")
    for line in closure["shadows_device"]:
        log(f"  carried although the device has it: {line}")
    for line in closure.get("shadows_base", []):
        log(f"  shadows the 0.22.1 bundle's: {line}")
    total = sum(p["bytes"] for p in manifest["parts"])
    log(
        f"{len(manifest['wheels'])} wheels, {manifest['uncompressed_bytes'] / MIB:.1f} MiB uncompressed -> "
        f"{total / MIB:.2f} MiB in {len(manifest['parts'])} parts (one device call each):"
    )
    for part in manifest["parts"]:
        log(f"  {part['name']}  {part['bytes'] / MIB:6.2f} MiB  sha256 {part['sha256'][:16]}…")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"bundle folder (default {DEFAULT_OUT})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"download cache (default {DEFAULT_CACHE})")
    parser.add_argument("--part-mib", type=float, default=60.0, help="largest part, MiB (default 60)")
    parser.add_argument("--xz-preset", type=int, default=9, choices=range(10), help="xz preset (default 9)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="xz threads")
    parser.add_argument("--extra", action="append", default=[], help="another pinned wheel to carry (name==version)")
    parser.add_argument("--allow-unmet", action="store_true", help="build even if requirements are unmet")
    parser.add_argument("--force", action="store_true", help="rebuild the compressed bundle even if up to date")
    parser.add_argument("--keep-joined", action="store_true", help=f"keep {BUNDLE_NAME} next to its parts")
    parser.add_argument("--stage", action="store_true", help="copy part i into build/gpu_parts/p<i>/ for carry")
    parser.add_argument(
        "--release",
        action="append",
        default=[],
        metavar="VERSION",
        help=f"build the release bundle of vllm==VERSION instead ({', '.join(RELEASES)}; repeatable); "
        "--stage puts it in build/gpu_parts/r<VERSION>/",
    )
    parser.add_argument(
        "--release-part-mib",
        type=float,
        default=RELEASE_PART_MIB,
        help=f"largest part of a release bundle, MiB (default {RELEASE_PART_MIB:g}: one call carries one part)",
    )
    args = parser.parse_args()
    args.out = args.out.expanduser().resolve()
    args.cache = args.cache.expanduser().resolve()
    if REPO in args.out.parents or args.out == REPO:
        parser.error("--out must be outside the repository (it would travel with every device call)")

    if args.release:
        for version in args.release:
            manifest = build_release(args, version)
            summarize(manifest)
            if args.stage:
                stage(args.out / f"r{version}", manifest)
        return 0
    manifest = build(args)
    summarize(manifest)
    if args.stage:
        stage(args.out, manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
