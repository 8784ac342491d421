"""Starting CUDA while torch is imported: the primary contexts of the conversion's GPUs, through the driver.

A cold ``transformd convert`` imports torch (4-5 s on the H200 machine) and then starts CUDA: the driver's
initialisation and a context on each GPU it converts on (0.3-0.4 s there). The driver needs no torch, and a call
through :mod:`ctypes` releases the GIL, so a thread does the second while the first runs: it creates the GPUs'
*primary* contexts, the ones torch (the CUDA runtime) takes when it starts, which then finds them made (its first
allocation took 0.02 s instead of 0.30-0.38 s). Only the GPUs the conversion will use get one (a context holds
GPU memory until the process ends). Best effort: where there is no NVIDIA driver (a CPU machine, ROCm), or it
refuses, nothing happens and torch starts CUDA itself, reporting any error. No torch here.

Once the driver gave a context, another thread computes Triton's key of its own build (:func:`_prime_triton`),
which the kernel's first load would otherwise compute while the conversion's first batch waits; it is not waited
for (a conversion that ends early does not wait for Triton's import).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path

#: The driver library (libcuda, as the CUDA runtime loads it).
DRIVER = "libcuda.so.1"


def start_cuda(device: str, shards: int) -> threading.Thread | None:
    """Create the primary contexts of the GPUs a conversion on ``device`` of ``shards`` shards uses, in a thread
    (returned; None when there is nothing to start): for ``auto`` and ``cuda``, the visible GPUs 0, 1, ... (the
    conversion spreads the shards over them in that order), one per shard at the most; none for ``cpu``, nor where
    torch was built without CUDA. Never raises: the conversion meets any error of CUDA's itself."""
    if device not in ("auto", "cuda") or shards < 1 or not _torch_has_cuda():
        return None
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # read by cuInit: as torch sets it before its own
    thread = threading.Thread(target=_start, args=(shards,), name="transformd-cuda-start", daemon=True)
    thread.start()
    return thread


def _torch_has_cuda() -> bool:
    """Whether the torch this process would import is a CUDA build (its ``libtorch_cuda``), without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
        return spec is not None and spec.origin is not None and any(
            (Path(spec.origin).parent / "lib").glob("libtorch_cuda*"))
    except (ImportError, ValueError, OSError):
        return False


def _start(most: int) -> None:
    if _retain_primary_contexts(most):
        _prime_triton_beside()


def _prime_triton_beside() -> None:
    """:func:`_prime_triton` on a thread of its own, which nobody waits for."""
    with contextlib.suppress(RuntimeError):  # (no new thread while the interpreter ends)
        threading.Thread(target=_prime_triton, name="transformd-triton-key", daemon=True).start()


def _retain_primary_contexts(most: int) -> bool:
    """Whether the driver gave a context (then the conversion runs Triton's kernel)."""
    retained = False
    try:
        cuda = ctypes.CDLL(DRIVER)
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
        for ordinal in range(min(most, count.value)):
            dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
            if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
                break
            # retained for the process' life (torch takes the same context; the process' exit releases it)
            retained |= cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    except Exception:  # noqa: BLE001, S110 - best effort: torch starts CUDA itself and reports its errors
        pass
    return retained


def _prime_triton() -> None:
    """Compute ``triton_key()``, Triton's key of its own build: a SHA-256 of libtriton and of its compiler's
    sources, which every process computes once, at its first kernel launch (0.37 s of the kernel's 0.53 s load on
    the H200 machine, while the conversion's first batch waits for that load). Here it runs while torch is
    imported: the hashing releases the GIL, Triton's import (and the subpackages its key walks) takes it from
    torch's import, work the kernel's load would have done anyway. Importing Triton does not import torch. Best
    effort, and only where the key is kept for the process (an ``lru_cache``)."""
    try:
        triton_key = _triton_key()
        if triton_key is not None and hasattr(triton_key, "cache_info"):
            triton_key()
    except Exception:  # noqa: BLE001, S110 - the kernel's load computes it (and meets any error) itself
        pass


def _triton_key() -> Callable[[], str] | None:
    """Triton's ``triton_key`` (in ``triton.runtime.cache``; in ``triton.compiler.compiler`` in older releases),
    or None without Triton."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    return triton_key
