"""Trust class 6: limits are checked before the work they limit.

Real daemon on a unix socket, real files:

* a source with a 64 GiB sparse file and a 1 GiB cache budget: 507 from the sizes alone, at once and on every
  POST (before: the whole file was hashed before the 507, again on every POST);
* a shard header listing 300,000 empty tensors: refused before the header is parsed (before: parsed, tens of
  seconds and hundreds of MiB of daemon memory);
* a 512 MiB sparse config.json: refused from its size (before: read and decoded whole; 4 GiB took the daemon's
  memory to 8.7 GB, and here the request ended in a MemoryError, 500).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from transformd.sample import write_sample_checkpoint

from .support.daemon import Daemons

pytestmark = pytest.mark.timeout(240)

CATEGORY = "trust 6: work before limits"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("trust-limits")
    (base / "models").mkdir()
    with Daemons() as daemons:
        daemon = daemons.start(cache_dir=base / "cache", cache_budget="1G", allow_roots=[base / "models"],
                               prefix="tdb-", log_level="critical")
        with daemon.client(timeout=120) as http:
            yield {"http": http, "models": base / "models"}


def test_a_source_over_budget_is_refused_before_hashing(world: dict[str, Any], fault_log) -> None:
    src = write_sample_checkpoint(world["models"] / "big", layers=1, experts=2)
    with open(src / "extra.bin", "wb") as f:
        f.truncate(64 << 30)  # sparse: no disk used, 64 GiB to hash
    times = []
    for _ in range(2):
        t = time.monotonic()
        r = world["http"].post("/v1/checkpoints", json={"source": str(src)})
        times.append(time.monotonic() - t)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "cache_full"
    assert max(times) < 3.0, times
    fault_log.record(CATEGORY, "64 GiB sparse file in a source, 1 GiB budget", 2,
                     f"507 cache_full from sizes, before hashing ({max(times):.2f} s at most)")


def test_a_header_with_too_many_tensors_is_refused_before_parsing(world: dict[str, Any], fault_log) -> None:
    src = write_sample_checkpoint(world["models"] / "many", layers=1, experts=2)
    shard = src / "model-00002-of-00002.safetensors"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    n = 300_000
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name}
    index["weight_map"].update({f"t{i}": shard.name for i in range(n)})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    t = time.monotonic()
    r = world["http"].post("/v1/checkpoints", json={"source": str(src)})
    took = time.monotonic() - t
    assert r.status_code == 422, r.text[:300]
    assert "more than" in r.json()["error"]["message"] and "tensors" in r.json()["error"]["message"]
    assert took < 10.0, took
    fault_log.record(CATEGORY, f"shard header listing {n} empty tensors", 1,
                     f"422 before parsing ({took:.1f} s, hashing included)")


def test_a_huge_config_is_refused_before_it_is_read(world: dict[str, Any], fault_log) -> None:
    """config.json (and hf_quant_config.json, the index) above ``MAX_JSON_BYTES`` is refused from its size. Before,
    a 4 GiB sparse config.json was read and decoded whole: the daemon's peak memory went from 0.3 to 8.7 GB for
    one request (a helper's measurement), and it still held 4.5 GB afterwards."""
    import resource

    from transformd.checkpoint.plan import MAX_JSON_BYTES

    src = write_sample_checkpoint(world["models"] / "huge-config", layers=1, experts=2)
    with open(src / "config.json", "r+b") as f:
        f.truncate(512 << 20)  # sparse: no disk used (within the budget: the size of the file itself is refused)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (the daemon runs in this process)
    t = time.monotonic()
    r = world["http"].post("/v1/checkpoints", json={"source": str(src)})
    took = time.monotonic() - t
    assert r.status_code == 422, r.text[:300]
    message = r.json()["error"]["message"]
    assert "config.json" in message and "above the limit" in message and str(MAX_JSON_BYTES >> 20) in message
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert took < 3.0 and grew_mib < 256, (took, grew_mib)
    fault_log.record(CATEGORY, "512 MiB sparse config.json", 1, f"422 from its size ({took:.2f} s), nothing read")
