"""The torch-free platform probe: AMD through a KFD topology tree, NVIDIA through a fake CUDA driver.

On the H200 the GPU suite compares :func:`detect_platform` with torch's own answer (tests/gpu/run_gpu_suite.py).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from transformd.platform import Platform, amd_platform, detect_platform, gfx_name, nvidia_platform


@pytest.mark.parametrize(
    ("version", "name"), [(90402, "gfx942"), (90400, "gfx940"), (90500, "gfx950"), (90010, "gfx90a"), (110001, "gfx1101")]
)
def test_gfx_names_follow_rocminfo(version: int, name: str) -> None:
    assert gfx_name(version) == name


def _kfd(root: Path, *versions: int) -> Path:
    """A topology: node 0 a CPU (gfx_target_version 0), then one GPU node per version."""
    for i, v in enumerate((0, *versions)):
        node = root / str(i)
        node.mkdir(parents=True)
        (node / "properties").write_text(f"cpu_cores_count {0 if v else 64}\nsimd_count 1216\ngfx_target_version {v}\n")
        (node / "name").write_text("" if not v else f"{gfx_name(v)}\n")
    (root / "not-a-node").mkdir()
    return root


def test_amd_gpu_is_read_from_the_kfd_topology(tmp_path: Path) -> None:
    nodes = _kfd(tmp_path / "nodes", 90402, 90500)
    assert amd_platform(nodes, {}) == Platform("amd", "gfx942", "gfx942")
    assert amd_platform(nodes, {}).fnuz and not amd_platform(nodes, {}).mx_native
    # the first visible index picks the GPU, as it does for torch; none visible is no GPU
    assert amd_platform(nodes, {"HIP_VISIBLE_DEVICES": "1,0"}) == Platform("amd", "gfx950", "gfx950")
    assert amd_platform(nodes, {"ROCR_VISIBLE_DEVICES": "1"}).mx_native
    assert amd_platform(nodes, {"CUDA_VISIBLE_DEVICES": "-1"}) is None
    assert amd_platform(nodes, {"HIP_VISIBLE_DEVICES": ""}) is None
    assert amd_platform(nodes, {"HIP_VISIBLE_DEVICES": "7"}) is None
    assert amd_platform(nodes, {"HIP_VISIBLE_DEVICES": "GPU-4a5b"}) == Platform("amd", "gfx942", "gfx942")


def test_no_kfd_or_only_cpu_nodes_is_no_amd_gpu(tmp_path: Path) -> None:
    assert amd_platform(tmp_path / "absent", {}) is None
    assert amd_platform(_kfd(tmp_path / "cpu-only"), {}) is None
    broken = _kfd(tmp_path / "broken", 90402)
    (broken / "1" / "properties").write_text("gfx_target_version not-a-number\n")
    assert amd_platform(broken, {}) is None


class _FakeDriver:
    """The five CUDA driver calls the probe makes; ``fail`` names one that returns an error code."""

    def __init__(self, major: int, minor: int, count: int = 1, fail: str | None = None):
        self.major, self.minor, self.count, self.fail = major, minor, count, fail

    def _rc(self, call: str) -> int:
        return 100 if call == self.fail else 0  # CUDA_ERROR_NO_DEVICE

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's names
        assert flags == 0
        return self._rc("cuInit")

    def cuDeviceGetCount(self, count) -> int:  # noqa: N802
        count._obj.value = self.count
        return self._rc("cuDeviceGetCount")

    def cuDeviceGet(self, dev, ordinal: int) -> int:  # noqa: N802
        assert ordinal == 0
        dev._obj.value = 0
        return self._rc("cuDeviceGet")

    def cuDeviceGetAttribute(self, value, attribute: int, dev) -> int:  # noqa: N802
        value._obj.value = {75: self.major, 76: self.minor}[attribute]
        return self._rc("cuDeviceGetAttribute")

    def cuDeviceGetName(self, buf, size: int, dev) -> int:  # noqa: N802
        ctypes.memmove(buf, b"NVIDIA H200\0", 12)
        return self._rc("cuDeviceGetName")


def test_nvidia_gpu_is_read_from_the_cuda_driver() -> None:
    assert nvidia_platform(_FakeDriver(9, 0)) == Platform("nvidia", "sm_90", "NVIDIA H200")
    assert nvidia_platform(_FakeDriver(10, 0)).mx_native and not nvidia_platform(_FakeDriver(8, 9)).mx_native
    assert nvidia_platform(_FakeDriver(9, 0, fail="cuDeviceGetName")) == Platform("nvidia", "sm_90", None)
    for call in ("cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute"):
        assert nvidia_platform(_FakeDriver(9, 0, fail=call)) is None, call
    assert nvidia_platform(_FakeDriver(9, 0, count=0)) is None, "CUDA_VISIBLE_DEVICES hid every GPU"


def test_detecting_the_platform_imports_no_torch() -> None:
    code = "import sys; from transformd.platform import detect_platform; p = detect_platform(); " \
           "assert p.vendor in ('none', 'nvidia', 'amd'), p; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_this_machine_matches_torch_where_torch_sees_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert detect_platform().vendor in ("none", "nvidia", "amd")  # a CPU torch says nothing of the hardware
        pytest.skip("torch sees no GPU here; the GPU suite compares on the device")
    props = torch.cuda.get_device_properties(0)
    expected = (str(getattr(props, "gcnArchName", "")).split(":")[0] if torch.version.hip
                else f"sm_{props.major}{props.minor}")
    assert detect_platform().arch == expected


def test_nvidia_is_preferred_to_an_amd_integrated_gpu(monkeypatch, tmp_path: Path) -> None:
    from transformd import platform

    monkeypatch.setattr(platform, "KFD_NODES", _kfd(tmp_path / "nodes", 110003))  # an APU's iGPU (gfx1103)
    monkeypatch.setattr(platform, "nvidia_platform", lambda: Platform("nvidia", "sm_100"))
    assert detect_platform({}) == Platform("nvidia", "sm_100")
    monkeypatch.setattr(platform, "nvidia_platform", lambda: None)
    assert detect_platform({}) == Platform("amd", "gfx1103", "gfx1103")
    monkeypatch.setattr(platform, "KFD_NODES", tmp_path / "absent")
    assert detect_platform({}) == Platform("none")
