"""Starting CUDA while torch is imported: the primary contexts of the conversion's GPUs, through the driver.

A cold ``transformd convert`` imports torch (4-5 s on the H200 machine) and then starts CUDA: the driver's
initialisation and a context on each GPU it converts on (0.3-0.4 s there). The driver needs no torch, and a call
through :mod:`ctypes` releases the GIL, so a thread does the second while the first runs: it creates the GPUs'
*primary* contexts, the ones torch (the CUDA runtime) takes when it starts, which then finds them made (its first
allocation took 0.02 s instead of 0.31-0.38 s). Best effort: where there is no NVIDIA driver (a CPU machine,
ROCm), or it refuses, nothing happens and torch starts CUDA itself, reporting any error. No torch here.
"""

from __future__ import annotations

import ctypes
import re
import threading

#: The driver library (libcuda, as the CUDA runtime loads it).
DRIVER = "libcuda.so.1"


def gpus_of(device: str | None) -> list[int] | None:
    """The GPU ordinals a conversion on ``device`` uses: ``cuda:N`` that one; ``auto``, ``cuda`` (or None) every
    visible one (None here: the driver counts them); [] for anything else (``cpu``)."""
    if device in (None, "auto", "cuda"):
        return None
    m = re.fullmatch(r"cuda:(\d+)", device)
    return [int(m.group(1))] if m else []


def start_cuda(device: str | None) -> threading.Thread | None:
    """Create the primary contexts of the GPUs a conversion on ``device`` uses, in a thread (returned; None when
    there is nothing to start). Never raises: the conversion meets any error of CUDA's itself."""
    gpus = gpus_of(device)
    if gpus == []:
        return None
    thread = threading.Thread(target=_retain_primary_contexts, args=(gpus,), name="transformd-cuda-start",
                              daemon=True)
    thread.start()
    return thread


def _retain_primary_contexts(gpus: list[int] | None) -> None:
    try:
        cuda = ctypes.CDLL(DRIVER)
        if cuda.cuInit(0) != 0:
            return
        if gpus is None:
            count = ctypes.c_int(0)
            if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return
            gpus = list(range(count.value))
        for ordinal in gpus:
            dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
            if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
                return
            # retained for the process' life (torch takes the same context; the process' exit releases it)
            cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    except Exception:  # noqa: BLE001, S110 - best effort: torch starts CUDA itself and reports its errors
        pass
