"""Names vLLM's GPU/CPU worker classes answer to over collective_rpc."""

from __future__ import annotations


def worker_method_names() -> set[str]:
    names: set[str] = set()
    from vllm.v1.worker.gpu_worker import Worker

    names.update(n for cls in Worker.__mro__ for n in vars(cls))
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker

        names.update(n for cls in CPUWorker.__mro__ for n in vars(cls))
    except ImportError:
        pass
    return names
