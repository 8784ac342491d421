"""Which GPU this process would convert for, found without importing torch.

``--target auto`` only needs the first visible GPU's vendor and architecture, and a warm cache hit should cost
Python's start-up, not torch's import and a CUDA context (seconds). So:

* AMD: the kernel's KFD topology (``/sys/class/kfd/kfd/topology/nodes/*/properties``), the same table ROCr
  enumerates: ``gfx_target_version`` is ``major * 10000 + minor * 100 + stepping`` (90402: ``gfx942``; minor
  and stepping print in hex, 90010: ``gfx90a``). The first index of ``HIP_VISIBLE_DEVICES`` /
  ``ROCR_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` (when an integer) picks the GPU, as it does for torch.
* NVIDIA: the driver API of ``libcuda.so.1`` through ctypes (``cuInit``, ``cuDeviceGet(0)``, compute
  capability attributes 75/76), which honours ``CUDA_VISIBLE_DEVICES`` and its ordering exactly as torch
  does, without creating a context.

Neither present: ``Platform("none")``. The answer is about the hardware, not about the torch build: a CPU-only
torch on an H200 still reports ``sm_90`` (the output is for the engine's GPU).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Where the KFD topology lives.
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
#: CUdevice_attribute values of the compute capability.
_CC_MAJOR, _CC_MINOR = 75, 76


@dataclass(frozen=True)
class Platform:
    """The accelerator the daemon or the CLI converts for."""

    vendor: str  #: "nvidia", "amd" or "none"
    arch: str | None = None  #: "gfx942", "sm_90", ...
    name: str | None = None

    @property
    def fnuz(self) -> bool:
        """gfx94x (MI300X, MI325X): float8 is FNUZ in hardware."""
        return self.vendor == "amd" and (self.arch or "").startswith("gfx94")

    @property
    def mx_native(self) -> bool:
        """MX-scaled matrix instructions: gfx950 (MI355X), NVIDIA compute capability 10.x and later."""
        if self.vendor == "amd":
            return (self.arch or "").startswith("gfx95")
        if self.vendor == "nvidia" and self.arch and self.arch.startswith("sm_"):
            return int(self.arch[3:]) >= 100
        return False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fnuz": self.fnuz, "mx_native": self.mx_native}


def detect_platform(environ: dict[str, str] | None = None) -> Platform:
    """The first visible GPU (NVIDIA through the CUDA driver, else AMD through KFD), or ``none``.

    NVIDIA first: a node with NVIDIA GPUs may also have an AMD integrated GPU in its KFD topology; a ROCm node
    has no ``libcuda.so.1``, which fails at once."""
    env = os.environ if environ is None else environ
    return nvidia_platform() or amd_platform(KFD_NODES, env) or Platform("none")


def gfx_name(target_version: int) -> str:
    """``gfx942`` for 90402: ``gfx{major}{minor:x}{stepping:x}``."""
    major, minor, stepping = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def amd_platform(nodes: Path, environ: dict[str, str] | os._Environ[str]) -> Platform | None:
    """The visible AMD GPU the KFD topology under ``nodes`` lists first, or None (no KFD, no GPU node)."""
    try:
        names = sorted((n for n in os.listdir(nodes) if n.isdigit()), key=int)
    except OSError:
        return None
    gpus: list[tuple[str, str | None]] = []
    for n in names:
        try:
            props = dict(line.split(None, 1) for line in (nodes / n / "properties").read_text().splitlines()
                         if len(line.split(None, 1)) == 2)
            version = int(props.get("gfx_target_version", "0"))
        except (OSError, ValueError):
            continue
        if version:  # 0: a CPU node
            gpus.append((gfx_name(version), _read_name(nodes / n / "name")))
    if not gpus:
        return None
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        visible = environ.get(var)
        if visible is None:
            continue
        first = visible.split(",")[0].strip()
        if not first.isdigit():
            return None if first in ("", "-1") else Platform("amd", gpus[0][0], gpus[0][1])
        if int(first) >= len(gpus):
            return None
        arch, name = gpus[int(first)]
        return Platform("amd", arch, name)
    return Platform("amd", gpus[0][0], gpus[0][1])


def _read_name(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def nvidia_platform(lib: Any = None) -> Platform | None:
    """The first visible NVIDIA GPU as the CUDA driver (``libcuda.so.1``, or ``lib``) reports it, or None."""
    if lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
    count, dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    if (lib.cuInit(0) or lib.cuDeviceGetCount(ctypes.byref(count)) or count.value < 1
            or lib.cuDeviceGet(ctypes.byref(dev), 0)
            or lib.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
            or lib.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)):
        return None  # no driver, no device, or none visible (CUDA_VISIBLE_DEVICES)
    label = name.value.decode(errors="replace") if lib.cuDeviceGetName(name, len(name), dev) == 0 else None
    return Platform("nvidia", f"sm_{major.value}{minor.value}", label or None)
