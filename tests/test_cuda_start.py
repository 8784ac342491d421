"""Starting CUDA through the driver while torch is imported (transformd/cuda_start.py), against a fake driver."""

from __future__ import annotations

import ctypes

import pytest

from transformd import cuda_start
from transformd.cuda_start import gpus_of, start_cuda


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
        if ordinal >= self.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev._obj.value = 1000 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        self.calls.append(("retain", dev.value - 1000))  # (the device by value, as the driver takes it)
        return 0


@pytest.fixture
def driver(monkeypatch) -> list[_FakeDriver]:
    """The fake driver each load of cuda_start.DRIVER gets (set ``driver[0]``; empty: no driver on this machine)."""
    loaded: list[_FakeDriver] = []
    real = ctypes.CDLL

    def load(name, *args, **kwargs):
        if name != cuda_start.DRIVER:
            return real(name, *args, **kwargs)
        if not loaded:
            raise OSError(f"{name}: cannot open shared object file")
        return loaded[0]

    monkeypatch.setattr(ctypes, "CDLL", load)
    return loaded


def test_the_gpus_of_a_device():
    assert gpus_of("cpu") == [] and gpus_of("cuda:1") == [1] and gpus_of("cudax") == []
    assert gpus_of("auto") is gpus_of("cuda") is gpus_of(None) is None  # every visible one: the driver counts them


@pytest.mark.parametrize(("device", "retained"), [("auto", [0, 1, 2]), ("cuda", [0, 1, 2]), ("cuda:1", [1])])
def test_it_retains_the_primary_context_of_each_gpu_the_conversion_uses(driver, device, retained):
    driver.append(_FakeDriver(devices=3))
    start_cuda(device).join(30)
    assert driver[0].calls[0] == ("cuInit", 0)
    assert [c[1] for c in driver[0].calls if c[0] == "retain"] == retained


def test_nothing_for_the_cpu(driver):
    driver.append(_FakeDriver())
    assert start_cuda("cpu") is None
    assert driver[0].calls == []


def test_no_driver_or_one_that_refuses_is_no_error(driver):
    start_cuda("auto").join(30)  # no driver here: the thread ends quietly (torch reports CUDA's errors itself)
    driver.append(_FakeDriver(init=100))  # CUDA_ERROR_NO_DEVICE
    start_cuda("auto").join(30)
    assert driver[0].calls == [("cuInit", 0)]
    driver[0] = _FakeDriver(devices=1)
    start_cuda("cuda:3").join(30)  # an ordinal the driver does not have
    assert not [c for c in driver[0].calls if c[0] == "retain"]
