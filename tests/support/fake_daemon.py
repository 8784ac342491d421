"""A stand-in for the transformd daemon that speaks its HTTP contract, for client and loader tests.

It converts nothing: a source registered with :meth:`FakeDaemon.register` (source directory ->
an already converted directory) goes queued -> converting -> ready over successive status polls,
and its ``/files`` table is built from the converted files' headers, as the real daemon does
(absolute offsets). Special source names drive the error paths:

* a directory whose name contains ``corrupt``: the conversion fails with a 422 error;
* ``boom``: the POST answers 500;
* ``slow``: never gets past ``converting``;
* ``hashing``: the POST takes 0.8 s to answer (identifying a large source);
* ``busy``: 503 (queue full, ``Retry-After``) while ``busy`` > 0, each answered after ``busy_answer_s``.

Sources must lie under ``allowed_root`` (403 ``source_not_allowed`` otherwise, after resolving symlinks) and exist
(404 ``source_not_found``). tests/test_client_contract.py runs the same contract tests against this fake and the
real daemon, so the two cannot drift apart.
:class:`ServerThread` serves an app with uvicorn on a unix socket or on 127.0.0.1:0 in a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from transformd.safetensors_io import read_header

STEPS = 3  # status polls from queued to ready


@dataclass
class Job:
    key: str
    source: str
    recipe: dict[str, Any]
    out: Path
    polls: int = 0
    failed: dict[str, Any] | None = None
    slow: bool = False
    shards_ready: set[str] = field(default_factory=set)

    def state(self) -> str:
        if self.failed and self.polls >= 1:
            return "failed"
        if self.polls == 0:
            return "queued"
        if self.slow or self.polls < STEPS:
            return "converting"
        return "ready"


class FakeDaemon:
    def __init__(self, allowed_root: Path) -> None:
        self.allowed_root = Path(allowed_root).resolve()
        self.outputs: dict[str, Path] = {}
        self.jobs: dict[str, Job] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.conversions = 0
        self.posts = 0
        self.busy = 0  # answers 503 to this many POSTs for a source named "busy"
        self.busy_answer_s = 0.0  # ... each after this many seconds (a loaded daemon)
        self.health: dict[str, Any] = {"status": "ok", "version": "0.1.0", "problems": []}
        self.health_status = 200  # transformd answers 503 with the same body when degraded
        self.lock = threading.Lock()

    def register(self, source: Path, converted: Path) -> None:
        self.outputs[str(Path(source).resolve())] = Path(converted).resolve()

    def forget(self) -> None:
        """Lose every job, as a restarted daemon would."""
        with self.lock:
            self.jobs.clear()

    # -- the app ------------------------------------------------------------------------------------------------------

    def app(self, token: str | None = None) -> FastAPI:
        app = FastAPI()
        daemon = self

        def error(status: int, code: str, message: str) -> JSONResponse:
            return JSONResponse({"error": {"status": status, "code": code, "message": message}}, status_code=status)

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if token is not None and request.headers.get("authorization") != f"Bearer {token}":
                return error(401, "unauthorized", "missing or wrong bearer token")
            return await call_next(request)

        @app.post("/v1/checkpoints")
        async def post_checkpoint(request: Request):
            body = await request.json()
            daemon.posts += 1
            if body.get("target") not in ("auto", "fnuz", "ocp") or body.get("scale_mode") not in ("exact", "amax"):
                return error(400, "bad_request", f"bad target/scale_mode in {body}")
            if body["target"] == "auto":  # as the real daemon decides on a node without an FNUZ or MX GPU
                body["target"] = "ocp"
            src = Path(body["source"])
            if src.name == "boom":
                return error(500, "internal", "something broke")
            if src.name == "hashing":
                await asyncio.sleep(0.8)  # a large source seen for the first time: the daemon reads it to key it
            if src.name == "busy" and daemon.busy > 0:
                daemon.busy -= 1
                await asyncio.sleep(daemon.busy_answer_s)
                response = error(503, "queue_full", "too many conversions queued; retry later")
                response.headers["Retry-After"] = "0.05"
                return response
            real = src.resolve()
            if real != daemon.allowed_root and daemon.allowed_root not in real.parents:
                return error(403, "source_not_allowed", f"source {src} (real path {real}) is outside the allowed roots "
                                                         f"({daemon.allowed_root})")
            if not real.is_dir():
                return error(404, "source_not_found", f"{src} does not exist")
            recipe = {"target": body["target"], "scale_mode": body["scale_mode"], "select": body.get("select")}
            key = hashlib.sha256(f"{real}|{sorted(recipe.items())}".encode()).hexdigest()[:32]
            with daemon.lock:
                job = daemon.jobs.get(key)
                if job is None:
                    daemon.conversions += 1
                    job = Job(key, str(real), recipe, daemon.outputs.get(str(real), real), slow="slow" in real.name)
                    if "corrupt" in real.name:
                        job.failed = {"status": 422, "code": "invalid_checkpoint",
                                      "message": f"file {real}/model.safetensors, tensor x.weight: E8M0 byte 0xFF"}
                    daemon.jobs[key] = job
            if job.state() == "ready":
                return JSONResponse(daemon.entry_json(job, with_size=True), status_code=200)
            return JSONResponse({"key": key, "state": job.state(), "progress": daemon.progress(job)}, status_code=202)

        @app.get("/v1/checkpoints/{key}")
        async def get_checkpoint(key: str):
            with daemon.lock:
                job = daemon.jobs.get(key)
                if job is None:
                    return error(404, "unknown_key", f"no entry {key}")
                job.polls += 1
                return daemon.entry_json(job)

        @app.get("/v1/checkpoints/{key}/files")
        async def get_files(key: str):
            job = daemon.jobs.get(key)
            if job is None:
                return error(404, "unknown_key", f"no entry {key}")
            return {"files": [daemon.file_json(job, p) for p in sorted(job.out.glob("*.safetensors"))]}

        @app.get("/v1/checkpoints/{key}/files/{name}")
        async def get_file(key: str, name: str):
            job = daemon.jobs.get(key)
            if job is None:
                return error(404, "unknown_key", f"no entry {key}")
            path = job.out / name
            if not path.is_file():
                return error(404, "unknown_file", f"entry {key} has no file {name}")
            entry = daemon.file_json(job, path)
            if not entry["ready"]:
                job.shards_ready.add(name)  # asked for: "converted" before the next request
                return JSONResponse(entry, status_code=202)
            return entry

        @app.post("/v1/checkpoints/{key}/leases", status_code=201)
        async def post_lease(key: str, request: Request):
            body = await request.json()
            if key not in daemon.jobs:
                return error(404, "unknown_key", f"no entry {key}")
            lease = {"id": uuid.uuid4().hex, "key": key, "expires_at": time.time() + float(body["ttl_s"]),
                     "holder": body.get("holder")}
            daemon.leases[lease["id"]] = lease
            return {k: lease[k] for k in ("id", "key", "expires_at")}

        @app.delete("/v1/checkpoints/{key}/leases/{lease_id}")
        async def delete_lease(key: str, lease_id: str):
            if daemon.leases.pop(lease_id, None) is None:
                return error(404, "unknown_lease", f"no lease {lease_id}")
            return Response(status_code=204)

        @app.delete("/v1/checkpoints/{key}")
        async def delete_checkpoint(key: str):
            if key not in daemon.jobs:
                return error(404, "unknown_key", f"no entry {key}")
            if any(lease["key"] == key for lease in daemon.leases.values()):
                return error(409, "leased", f"entry {key} is leased")
            del daemon.jobs[key]
            return Response(status_code=204)

        @app.get("/v1/cache")
        async def get_cache():
            return {"budget_bytes": 1 << 40, "used_bytes": 0,
                    "entries": [{"key": j.key, "state": j.state()} for j in daemon.jobs.values()]}

        @app.get("/healthz")
        async def healthz():
            return JSONResponse(daemon.health, status_code=daemon.health_status)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f"transformd_conversions_total {daemon.conversions}\n")

        return app

    # -- JSON ---------------------------------------------------------------------------------------------------------

    @staticmethod
    def progress(job: Job) -> dict[str, Any]:
        done = min(job.polls, STEPS)
        return {"tensors_done": 10 * done, "tensors_total": 10 * STEPS, "bytes_done": 1000 * done,
                "bytes_total": 1000 * STEPS, "rate_bytes_per_s": 1000.0, "eta_s": float(STEPS - done)}

    def entry_json(self, job: Job, with_size: bool = False) -> dict[str, Any]:
        state = job.state()
        out: dict[str, Any] = {"key": job.key, "state": state, "progress": self.progress(job), "source": job.source,
                               "recipe": job.recipe, "error": job.failed if state == "failed" else None}
        if state == "ready":
            out["path"] = str(job.out)
            if with_size:
                out.update(files_url=f"/v1/checkpoints/{job.key}/files",
                           size_bytes=sum(p.stat().st_size for p in job.out.iterdir() if p.is_file()))
        return out

    @staticmethod
    def file_json(job: Job, path: Path) -> dict[str, Any]:
        header = read_header(path)
        ready = job.state() == "ready" or path.name in job.shards_ready
        return {
            "name": path.name,
            "path": str(path.resolve()) if ready else None,  # null: not written yet
            "final_path": str(path.resolve()),
            "size": header.file_size,
            "digest": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() if ready else None,
            "ready": ready,
            "tensors": {t.name: {"dtype": t.dtype, "shape": list(t.shape), "offsets": [t.begin, t.end]}
                        for t in header.tensors.values()},
        }


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread, on ``uds`` or on 127.0.0.1 with a free port."""

    def __init__(self, app: FastAPI, *, uds: str | None = None) -> None:
        kwargs: dict[str, Any] = {"uds": uds} if uds else {"host": "127.0.0.1", "port": 0}
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **kwargs)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.uds = uds

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
