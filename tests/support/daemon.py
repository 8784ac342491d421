"""Starting real daemons in tests: :class:`Daemons` starts each one in a thread of this process
(:class:`~transformd.daemon.testing.DaemonThread`, what ``transformd serve`` runs) on a unix socket in its own short
directory under /tmp, and stops them all and removes those directories when closed.

The ``daemons`` fixture of tests/conftest.py is one per test; a module-scoped fixture uses ``with Daemons() as d``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformd.daemon.settings import Settings
from transformd.daemon.testing import DaemonThread, short_tempdir


class Daemons:
    """Real daemons started by one test (or module); a context manager that stops them all on exit."""

    def __init__(self) -> None:
        self._daemons: list[DaemonThread] = []
        self._runs: list[Path] = []

    def start(
        self,
        converter: Any = None,
        *,
        cache_dir: str | Path,
        allow_roots: list[Path] | tuple[Path, ...] = (),
        prefix: str = "td-",
        socket_name: str = "td.sock",
        platform: Any = None,
        **settings: Any,
    ) -> DaemonThread:
        """A started daemon with ``settings`` (as ``transformd serve`` takes them) over these defaults: a socket
        ``socket_name`` in a new short directory (``settings["socket"]`` replaces it, None for TCP only), the CPU,
        log level warning. ``converter``: the cache's converter (default: the real one); ``platform``: the GPU
        that target ``auto`` decides for (default: detected)."""
        run = short_tempdir(prefix)
        self._runs.append(run)
        base: dict[str, Any] = {
            "socket": run / socket_name,
            "cache_dir": cache_dir,
            "allow_roots": list(allow_roots),
            "device": "cpu",
            "log_level": "warning",
        }
        base.update(settings)
        daemon = DaemonThread(Settings(**base), converter=converter, platform=platform).start()
        self._daemons.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self._daemons:
            daemon.stop()
        for run in self._runs:
            shutil.rmtree(run, ignore_errors=True)
        self._daemons.clear()
        self._runs.clear()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
