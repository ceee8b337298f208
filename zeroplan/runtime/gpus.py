"""How many CUDA GPUs this process may use, found WITHOUT initialising CUDA.

``torch.cuda.is_available()`` / ``device_count()`` in a parent that then forks ranks leaves every
child failing "Cannot re-initialize CUDA in forked subprocess" (PyTorch's torch/cuda/__init__.py
``_lazy_init`` refuses in a child when the parent has initialised CUDA). The launcher therefore
counts GPUs through NVML (pynvml, a core dependency), which never touches the CUDA runtime, and
applies ``CUDA_VISIBLE_DEVICES`` as the CUDA driver does (comma list of indices or ``GPU-``/``MIG-``
UUIDs; enumeration stops at the first invalid entry; an empty value hides every GPU) — the same
rule as PyTorch's NVML-based count (``torch.cuda._device_count_nvml``, used when
``PYTORCH_NVML_BASED_CUDA_CHECK=1``).

Tests replace ``nvml_device_count`` (monkeypatch) to exercise the GPU paths without a GPU.
"""

from __future__ import annotations

import os

from zeroplan._util import InputError

__all__ = ["nvml_device_count", "visible_gpu_count", "visible_gpu_free_bytes", "torch_has_cuda", "resolve_backend"]


def nvml_device_count() -> int:
    """GPUs the NVIDIA driver reports (0 without a driver or without pynvml)."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _visible(raw: str, physical: int) -> int:
    """Devices left visible by a CUDA_VISIBLE_DEVICES value over ``physical`` GPUs."""
    return len(_visible_entries(raw, physical))


def _visible_entries(raw: str, physical: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries the driver keeps (indices as text, or UUIDs), in order."""
    seen: list[str] = []
    for item in raw.split(","):
        item = item.strip()
        if item.startswith(("GPU-", "MIG-")):
            key = item
        else:
            try:
                idx = int(item)
            except ValueError:
                break  # the driver stops at the first invalid entry
            if idx < 0 or idx >= physical:
                break
            key = str(idx)
        if key in seen:
            break  # a repeated device is invalid too
        seen.append(key)
    return seen[:physical]


def visible_gpu_free_bytes() -> list[int] | None:
    """Free memory in bytes of each GPU this process may use, read through NVML (never the CUDA
    runtime, so forked ranks can still start CUDA); None when NVML cannot say (no driver, no
    pynvml, an entry NVML cannot resolve). NVML's index order is the PCI order, which CUDA's
    default order need not follow, so the list is a set of GPUs, not CUDA device 0, 1, ..."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: nothing to say
        return None
    try:
        physical = int(pynvml.nvmlDeviceGetCount())
        raw = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = [str(i) for i in range(physical)] if raw is None else _visible_entries(raw, physical)
        handles = [pynvml.nvmlDeviceGetHandleByUUID(e) if e.startswith(("GPU-", "MIG-"))
                   else pynvml.nvmlDeviceGetHandleByIndex(int(e)) for e in entries]
        return [int(pynvml.nvmlDeviceGetMemoryInfo(h).free) for h in handles]
    except Exception:  # noqa: BLE001 - an NVML error: say nothing rather than guess
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def visible_gpu_count() -> int:
    """GPUs this process could use under CUDA, without initialising CUDA."""
    physical = nvml_device_count()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return physical
    return _visible(raw, physical)


def torch_has_cuda() -> bool:
    """True when the installed torch was built with CUDA (a constant; no CUDA call)."""
    import torch

    return getattr(torch.version, "cuda", None) is not None


def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> 'nccl' when torch has CUDA and NVML sees a visible GPU, else 'gloo'.

    Never calls ``torch.cuda.is_available()``: that would initialise CUDA in the parent and
    break every forked rank.
    """
    if backend == "auto":
        return "nccl" if torch_has_cuda() and visible_gpu_count() > 0 else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InputError(f"--backend {backend!r}: expected auto, gloo or nccl")
    return backend
