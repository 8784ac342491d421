"""The suite's collection under pytest-xdist (tests/conftest.py): every test has its own node id, or none runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _pytest.nodeid import NodeId

from tests.conftest import pytest_collection_modifyitems


class _Item(SimpleNamespace):
    @property
    def nodeid(self) -> str:
        return str(self._id)


def _item(label: str | None = None) -> _Item:
    return _Item(_id=NodeId.parse("tests/test_daemon_fuzz.py::test_fuzz"), operation_label=label)


def test_schemathesis_items_get_their_operation_into_the_node_id() -> None:
    items = [_item("GET /healthz"), _item("POST /v1/checkpoints")]
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ["tests/test_daemon_fuzz.py::test_fuzz[GET /healthz]",
                                         "tests/test_daemon_fuzz.py::test_fuzz[POST /v1/checkpoints]"]


def test_other_items_under_one_node_id_stop_the_run() -> None:
    """pytest-xdist would run one of them and say nothing of the others."""
    with pytest.raises(pytest.UsageError, match=r"same node id: tests/test_daemon_fuzz.py::test_fuzz"):
        pytest_collection_modifyitems([_item(), _item()])
