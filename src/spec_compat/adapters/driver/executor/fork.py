"""Fork/CUDA safety of the worker start (part of the ``executor`` adapter's subclass).

vLLM forks its workers unless torch reports CUDA initialised; a CUDA driver initialised without
torch noticing makes forked workers fail. The subclass starts its workers with spawn then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

MP_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
CUDA_SUCCESS = 0
logger = logging.getLogger("spec_compat.executor")


def cuda_driver_initialized() -> bool:
    """Whether the CUDA driver was initialised (``cuInit``) in this process, asking it nothing else.

    vLLM switches its workers from fork to spawn only when ``torch.cuda.is_initialized()``; but
    ``torch.cuda.is_available()`` (``cudaGetDeviceCount``) runs ``cuInit`` and arms torch's fork
    check while leaving that False, and a worker forked afterwards fails with "Cannot re-initialize
    CUDA in forked subprocess" (seen on 2 x H200, docs/gpu/run3_fork_fallback.txt). ``import vllm``
    sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which makes later calls harmless, so this happens when
    something calls it before vLLM is imported: user code, or ``import speculators`` ahead of
    ``spec_compat.apply()`` (speculators 0.4.x calls it at import, in
    ``speculators.models.eagle3.core.conditional_torch_compile``). Checked without loading or
    initialising anything: libcuda is looked up only if already loaded (``RTLD_NOLOAD``), and
    ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED until ``cuInit`` has run."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count = ctypes.c_int(0)
        return bool(libcuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_SUCCESS)
    except (OSError, AttributeError):  # not loaded in this process (or no such symbol): not initialised
        return False


def start_method_env() -> dict[str, str]:
    """``{VLLM_WORKER_MULTIPROC_METHOD: "spawn"}`` when the workers would be forked from a process
    whose CUDA driver is initialised (see ``cuda_driver_initialized``): the same switch vLLM's
    ``_maybe_force_spawn`` makes when torch reports CUDA initialised, for the case it cannot see."""
    if os.environ.get(MP_METHOD_ENV, "fork") == "spawn" or not cuda_driver_initialized():
        return {}
    logger.warning(
        "spec_compat: the CUDA driver is already initialised in this process (torch.cuda.is_available() "
        "called before vLLM was imported?), so forked vLLM workers could not use CUDA; starting them with "
        "spawn instead of fork (to keep fork, import vllm or call spec_compat.apply() first, or set "
        "PYTORCH_NVML_BASED_CUDA_CHECK=1)"
    )
    return {MP_METHOD_ENV: "spawn"}
