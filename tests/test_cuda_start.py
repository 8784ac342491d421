"""Starting CUDA through the driver while torch is imported (transformd/cuda_start.py), against a fake driver."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest

from transformd import cuda_start
from transformd.cuda_start import start_cuda

_PRIME_BESIDE = cuda_start._prime_triton_beside  # (the driver fixture replaces it)


class _FakeDriver:
    """libcuda's calls that cuda_start makes, recorded; ``devices`` GPUs; ``init`` cuInit's result."""

    def __init__(self, devices: int = 3, init: int = 0):
        self.devices, self.init, self.calls = devices, init, []

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        self.calls.append(("cuInit", flags))
        return self.init

    def cuDeviceGetCount(self, count):  # noqa: N802
        count._obj.value = self.devices
        self.calls.append(("cuDeviceGetCount",))
        return 0

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        assert ordinal < self.devices, "an ordinal the driver does not have"
        dev._obj.value = 1000 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        self.calls.append(("retain", dev.value - 1000))  # (the device by value, as the driver takes it)
        return 0


@pytest.fixture
def driver(monkeypatch) -> list[_FakeDriver]:
    """The fake driver each load of cuda_start.DRIVER gets (set ``driver[0]``; empty: no driver on this machine),
    with a torch built with CUDA."""
    loaded: list[_FakeDriver] = []
    real = ctypes.CDLL

    def load(name, *args, **kwargs):
        if name != cuda_start.DRIVER:
            return real(name, *args, **kwargs)
        if not loaded:
            raise OSError(f"{name}: cannot open shared object file")
        return loaded[0]

    monkeypatch.setattr(ctypes, "CDLL", load)
    monkeypatch.setattr(cuda_start, "_torch_has_cuda", lambda: True)
    monkeypatch.setattr(cuda_start, "_prime_triton_beside", lambda: loaded[0].calls.append(("prime triton",)))
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    return loaded


def _retained(driver: _FakeDriver) -> list[int]:
    return [c[1] for c in driver.calls if c[0] == "retain"]


@pytest.mark.parametrize(("device", "shards", "retained"),
                         [("auto", 5, [0, 1, 2]), ("cuda", 3, [0, 1, 2]), ("auto", 2, [0, 1]), ("cuda", 1, [0])])
def test_it_retains_the_primary_contexts_of_the_gpus_the_conversion_uses(driver, device, shards, retained):
    """The conversion spreads its shards over GPUs 0, 1, ...: one per shard at the most."""
    driver.append(_FakeDriver(devices=3))
    start_cuda(device, shards).join(30)
    assert driver[0].calls[0] == ("cuInit", 0)
    assert _retained(driver[0]) == retained
    assert driver[0].calls[-1] == ("prime triton",), "then Triton's key, once"
    assert driver[0].calls.count(("prime triton",)) == 1
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # set before cuInit reads it, as torch does before its own


def test_nothing_for_the_cpu_no_shards_or_a_torch_without_cuda(driver, monkeypatch):
    driver.append(_FakeDriver())
    assert start_cuda("cpu", 3) is None
    assert start_cuda("auto", 0) is None
    monkeypatch.setattr(cuda_start, "_torch_has_cuda", lambda: False)
    assert start_cuda("auto", 3) is None
    assert driver[0].calls == []


def test_no_driver_or_one_that_refuses_is_no_error(driver):
    start_cuda("auto", 2).join(30)  # no driver here: the thread ends quietly (torch reports CUDA's errors itself)
    driver.append(_FakeDriver(init=100))  # CUDA_ERROR_NO_DEVICE
    start_cuda("auto", 2).join(30)
    assert driver[0].calls == [("cuInit", 0)]
    driver[0] = _FakeDriver(devices=0)
    start_cuda("cuda", 2).join(30)
    assert not _retained(driver[0])
    assert ("prime triton",) not in driver[0].calls, "no GPU to run Triton's kernel on: its key is not computed"


def test_triton_s_key_is_not_waited_for(driver, monkeypatch):
    """The caller joins the contexts' thread only (at the end of a conversion, or when it fails early): Triton's
    import and key go on beside it, on a thread of their own."""
    driver.append(_FakeDriver(devices=1))
    began, release = threading.Event(), threading.Event()
    monkeypatch.setattr(cuda_start, "_prime_triton_beside", _PRIME_BESIDE)
    monkeypatch.setattr(cuda_start, "_prime_triton", lambda: (began.set(), release.wait(30)))
    try:
        thread = start_cuda("cuda", 1)
        thread.join(10)
        assert not thread.is_alive() and _retained(driver[0]) == [0]
        assert began.wait(10) and any(t.name == "transformd-triton-key" for t in threading.enumerate())
    finally:
        release.set()


def test_it_knows_a_cuda_build_of_torch_without_importing_it():
    code = ("import sys\nfrom transformd.cuda_start import _torch_has_cuda\nfound = _torch_has_cuda()\n"
            "assert 'torch' not in sys.modules\nimport torch\nprint(found, torch.version.cuda is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    found, built = done.stdout.split()
    assert found == built


def test_triton_s_key_is_computed_once_for_the_process_without_torch():
    """What the thread does after the contexts: Triton's key of its build, kept for the kernel's first load, and no
    torch imported (the thread runs while the main thread imports it)."""
    triton_key = cuda_start._triton_key()
    if triton_key is None or not hasattr(triton_key, "cache_info"):
        pytest.skip("no Triton here, or one whose triton_key is not kept for the process")
    code = ("import sys\nfrom transformd.cuda_start import _prime_triton, _triton_key\n_prime_triton()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\ntriton_key = _triton_key()\n"
            "info = triton_key.cache_info()\nassert (info.misses, info.currsize) == (1, 1), info\n"
            "key = triton_key()\nimport triton\n"
            "assert triton_key.cache_info().hits == 1 and key.startswith(triton.__version__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
