"""The FastAPI application: routes of the versioned API, wired to the cache and the conversion service.

:func:`create_app` builds one app per daemon (its own cache handle, service, metrics registry).
Every handler that touches the file system does it in a worker thread; conversions run in the
service's threads. See :mod:`transformd.daemon` for the endpoints and :mod:`.errors` for the status codes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Query, Request
from fastapi import Path as FastApiPath
from fastapi.responses import JSONResponse, Response

from .. import request
from ..cache import Cache, EntryLeasedError, EntryNotFoundError, PendingIdentity, Recipe, SourceIdentity, cache_key
from ..cache.keys import KEY_HEX_LEN, KEY_RE
from ..cache.lease import LEASE_ID_RE
from ..checkpoint.layout import Layout, layout_for
from ..engines import Platform, choose_target
from ..hub import HubResolver
from ..platform import detect_platform
from .docs import install_docs
from .errors import ApiError, error_for_exception, install_error_handlers
from .files import EntryIndex
from .hub_sources import alias_of, hub_source, key_first, remember_hub, with_hub
from .metrics import CONTENT_TYPE, Metrics
from .middleware import BearerAuth, BodyLimit, RequestCounter
from .paths import FILE_NAME_RE, SourcePolicy, check_file_name
from .fscreds import Reader, caller_reads
from .peers import Caller, path_denied, unreadable
from .schemas import (
    CacheModel,
    CheckpointInfo,
    CheckpointRequest,
    ErrorResponse,
    FileModel,
    FilesResponse,
    HealthModel,
    LeaseModel,
    LeaseRequest,
)
from .service import ConversionService
from .settings import Settings
from .shards import TransformdShardConverter
from .state import Daemon
from .sources import check_engine, plan_readiness, readable_source, source_layout_of, unnamed_refusal_of
from .views import entry_view, foreign_view, job_file, job_files, job_view, passthrough_view

#: Seconds between two refreshes of the cache size gauges by /metrics.
GAUGE_REFRESH_S = 2.0

log = logging.getLogger("transformd.daemon")


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse} for code in codes}


KeyParam = Annotated[
    str,
    FastApiPath(
        description=f"cache key: {KEY_HEX_LEN} lowercase hex digits (else 400)",
        json_schema_extra={"pattern": f"^[0-9a-f]{{{KEY_HEX_LEN}}}$"},
    ),
]
#: Longest a status request waits for its conversion to end (``?wait=``): well inside a client's request timeout.
MAX_STATUS_WAIT_S = 10.0
WaitParam = Annotated[
    float,
    Query(ge=0, le=MAX_STATUS_WAIT_S, description="seconds to wait for a queued or converting checkpoint to end "
          "(ready or failed) before answering its state; 0 (default): answer at once"),
]
NameParam = Annotated[
    str,
    FastApiPath(
        description="a shard's file name, e.g. model-00001-of-00002.safetensors: no '/', no '..' (else 404)",
        json_schema_extra={"pattern": f"^(?!.*\\.\\.){FILE_NAME_RE.pattern.lstrip('^')}"},
    ),
]
LeaseIdParam = Annotated[
    str,
    FastApiPath(
        description="lease id: 16 lowercase hex digits (else 404)", json_schema_extra={"pattern": "^[0-9a-f]{16}$"}
    ),
]


def check_key(key: str) -> str:
    """``key`` if it is a cache key; a 400 error otherwise (nothing on disk is touched)."""
    if not KEY_RE.fullmatch(key):
        raise ApiError(400, "invalid_key", f"{key[:80]!r} is not a checkpoint key ({KEY_HEX_LEN} lowercase hex digits)")
    return key


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _accepted(body: dict[str, Any]) -> JSONResponse:
    return _json(body, 202, {"Location": body["status_url"], "Retry-After": "1"})


def _unknown_key(key: str) -> ApiError:
    return ApiError(404, "unknown_key", f"no checkpoint with key {key}: POST /v1/checkpoints with its source first")


async def _thread(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Run blocking ``func`` in a worker thread; library errors become API errors."""
    try:
        return await anyio.to_thread.run_sync(lambda: func(*args, **kwargs))
    except ApiError:
        raise
    except Exception as exc:
        raise error_for_exception(exc) from exc


def create_app(
    settings: Settings | None = None,
    *,
    converter: Any = None,
    cache: Cache | None = None,
    platform: Platform | None = None,
) -> FastAPI:
    """The daemon's ASGI app. ``converter``: a cache converter (default :class:`TransformdShardConverter`);
    ``platform``: the GPU that target ``auto`` decides for (default: detected)."""
    from .. import __version__

    settings = settings or Settings()
    settings.check()
    token = settings.load_token()
    policy = SourcePolicy(settings.source_roots())
    if converter is None:
        converter = TransformdShardConverter(settings.device)
    if cache is None:
        cache = Cache(
            settings.cache_dir, budget_bytes=settings.cache_budget, converter=converter, device=settings.device
        )
    cache.allowed_roots = policy.roots  # every source file is checked on its open descriptor (cache.securefs)
    metrics = Metrics()
    tier = None if not settings.remote else request.Tier.from_url(  # (a malformed URL fails the start, in one line)
        settings.remote, read_only=settings.remote_read_only, on_count=metrics.count_remote)
    entries = EntryIndex(cache)
    daemon: Daemon

    def on_change() -> None:
        daemon.refresh_gauges()

    service = ConversionService(
        cache,
        converter,
        policy,
        metrics,
        tier=tier,
        max_concurrent=settings.max_concurrent_conversions,
        max_queued=settings.max_queued_conversions,
        on_change=on_change,
        on_converted=lambda key, uid: daemon.converted(key, uid),
    )
    daemon = Daemon(settings, cache, service, entries, metrics, policy, settings.device, platform or detect_platform())
    daemon.hub = HubResolver(settings.hub_cache_dir(), policy.roots, allow_download=settings.allow_download)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        if isinstance(converter, TransformdShardConverter):  # fails the start when --device cuda has no GPU
            from ..convert import resolve_device

            daemon.device = str(await anyio.to_thread.run_sync(resolve_device, settings.device))
        with contextlib.suppress(Exception):
            await anyio.to_thread.run_sync(daemon.refresh_gauges)
        log.info("transformd %s: cache %s, allowed roots %s%s", __version__, cache.root, policy.describe(),
                 "" if tier is None else f", remote tier {tier.remote.url}{' (read-only)' if tier.read_only else ''}")
        log.info("callers' reads: %s", caller_reads())  # (probed once, at start: see .fscreds)
        try:
            yield
        finally:
            await service.close(settings.shutdown_grace_s)

    app = FastAPI(
        title="transformd",
        version=__version__,
        description="Converts MXFP8 checkpoints to 128x128 block FP8 once per node, caches them, and serves the "
        'converted shards for memory mapping. Errors are `{"error": {"status", "code", "message"}}`.',
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc come from .docs, with local assets (the defaults load them from a CDN)
        redoc_url=None,
        # every route: 401 on TCP without the token, 503 when the cache or the daemon cannot serve, 500 for bugs
        responses=_errors(401, 500, 503),
    )
    app.state.daemon = daemon
    install_error_handlers(app)
    _routes(app, daemon)
    install_docs(app)
    _document_settings(app, settings)
    app.add_middleware(RequestCounter, metrics=metrics)  # innermost of the three: sees the matched route
    app.add_middleware(BodyLimit, timeout_s=settings.header_timeout_s)
    if token is not None:
        socket_path = settings.socket_path()
        app.add_middleware(BearerAuth, token=token, unix_paths=[str(socket_path)] if socket_path else [])
    return app


def _document_settings(app: FastAPI, settings: Settings) -> None:
    """Put this daemon's limits into its OpenAPI schema (they are settings, not constants of the models)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            ttl = doc.get("components", {}).get("schemas", {}).get("LeaseRequest", {}).get("properties", {})
            if "ttl_s" in ttl:
                ttl["ttl_s"]["maximum"] = settings.max_lease_ttl_s
                ttl["ttl_s"]["description"] = (
                    f"{ttl['ttl_s'].get('description', '')} (this daemon: at most {settings.max_ttl_of(False):g} s "
                    f"for a caller who is not an admin, {settings.max_lease_ttl_s:g} s for an admin; above is 400)"
                ).strip()
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _routes(app: FastAPI, d: Daemon) -> None:
    cache, service, entries, metrics = d.cache, d.service, d.entries, d.metrics

    async def authorize(request: Request, key: str) -> Caller:
        """The caller, if it may be served ``key``: it could read the key's source itself (or is an admin)."""
        caller = d.caller(request)
        if d.may_see(key, caller):
            return caller
        async with d.source_slot(caller):  # (it opens the key's source)
            if await anyio.to_thread.run_sync(d.check_source_of, key, caller, limiter=service.source_limiter()):
                return caller
        raise ApiError(
            403,
            "permission_denied",
            f"{caller.describe()} may not use checkpoint {key}: it is served only to callers who can read its "
            "source (POST /v1/checkpoints with a source you can read)",
        )

    @app.post(
        "/v1/checkpoints",
        response_model=CheckpointInfo,
        status_code=200,
        summary="Resolve a checkpoint: the cached conversion (200) or a conversion started or running (202)",
        responses={
            202: {"model": CheckpointInfo, "description": "queued or converting"},
            **_errors(400, 403, 404, 409, 413, 422, 503, 507),
        },
        tags=["checkpoints"],
    )
    async def post_checkpoint(body: CheckpointRequest, request: Request) -> Response:
        caller = d.caller(request)
        await d.check_select(body.select)  # (422 for a pattern RE2 refuses, before anything else)
        reader = d.reader(caller)  # every open of the source for this request: the caller's own (fscreds)
        slot = d.source_slot(caller)  # held for the work on the source: a caller takes a few source threads at most
        target, reason = choose_target(body.target, body.engine, d.platform)
        aliases = [] if target is None else [  # (with a remote tier: a repo id and commit not cached here)
            Recipe(target=target, scale_mode=body.scale_mode, select=body.select, layout=layout)
            for layout in dict.fromkeys((layout_for(body.engine), Layout.AS_IS))]
        async with slot:  # {} for a path; else its snapshot, or (not here) the entry a tier's alias record names
            hub, aliased = await hub_source(d, body.source, body.revision, reader, recipes=aliases)
        if aliased is not None:
            return await _by_alias(*aliased, caller, body, reason)
        source = d.policy.check_syntax(hub["hub"]["snapshot"] if hub else body.source)
        if not reader.kernel and (missing := await _thread(path_denied, caller, source, d.policy.allowed)) is not None:
            raise unreadable(caller, source, missing)  # (before anything of it is looked at: no 404, 422 or 507 said)
        if target is None:  # native MX: the engine loads the source itself
            async with slot:
                real = await _thread(readable_source, d, source, reader)
            return _json({**passthrough_view(real, reason), **hub})
        layout = layout_for(body.engine)
        if layout is not Layout.AS_IS:  # (per-expert only for a source with a fused stack: else the same entry)
            async with slot:
                layout = await _thread(source_layout_of, d.cache, source, body.engine, reader)
        recipe = Recipe(target=target, scale_mode=body.scale_mode, select=body.select, layout=layout)
        async with slot:
            ident = await service.identify(source, defer=True, reader=reader)
            if await key_first(d, ident, hub, recipe):
                ident = await service.identify(source, reader=reader)  # (the tier is asked by key: hashed first)
        if isinstance(ident, PendingIdentity):  # large, never hashed: its conversion hashes it as it reads it
            answer = await _resolve_while_hashing(ident, source, recipe, reader, body, hub, reason)
            if answer is not None:
                return answer
            async with slot:
                ident = await service.identify(source, reader=reader)  # no worker free now: hash first
        missing = reader.denied(ident.access) if ident.access is not None else None
        if missing is not None:
            raise unreadable(caller, source, missing)
        key = cache_key(ident, recipe)
        remember_hub(d, key, hub)
        job = service.job(key)
        if job is None or not job.active:
            invalid = service.known_invalid(key, ident.path)
            if invalid is not None:
                metrics.cache_misses.inc()
                raise invalid
            info = await _thread(entries.info, key, touch=True)
            if info is not None:
                metrics.cache_hits.inc()
                d.grant(key, caller)
                return await _ready(info, job, reason, body.engine, hub)
        metrics.cache_misses.inc()
        async with _admitted(reader, key, source, body, recipe, identity=ident) as planned:
            d.grant(key, caller)  # (after its admission: a refused request leaves no grant behind, an attack review)
            job = await service.ensure_job(key, ident.path, recipe, uid=caller.uid, identity=ident, reader=reader,
                                           planned=planned, alias=alias_of(hub))
        assert job is not None
        return await _answer(key, job, reason, body.engine, hub)

    async def _resolve_while_hashing(
        pending: PendingIdentity, source: str, recipe: Recipe, reader: Reader, body: CheckpointRequest,
        hub: dict[str, Any], reason: str | None,
    ) -> Response | None:
        """POST's answer for a source converted while it is hashed (read once): a job under the source's
        provisional name, answered once the hashing has the key, as ``queued``/``converting`` (202), or ``ready``
        when that key was cached already. None when no worker is free for it at once."""
        caller = reader.caller
        missing = reader.denied(pending.access)
        if missing is not None:
            raise unreadable(caller, source, missing)
        slot = pending.slot(recipe)
        async with _admitted(reader, slot, source, body, recipe, slot=slot) as planned:
            job = await service.ensure_job(slot, pending.path, recipe, uid=caller.uid, provisional=True,
                                           reader=reader, planned=planned, alias=alias_of(hub))
        if job is None:
            return None
        key = await service.keyed(job)
        d.grant(key, caller)
        remember_hub(d, key, hub)
        if job.state == "ready" and job.outcome == "hit":  # a copy of content already cached
            metrics.cache_hits.inc()
        else:
            metrics.cache_misses.inc()
        return await _answer(key, job, reason, body.engine, hub)

    async def _by_alias(key: str, hub: dict[str, Any], recipe: Recipe, caller: Caller, body: CheckpointRequest,
                        reason: str | None) -> Response:
        """POST's answer for a repo id and commit the tier's alias record names: the entry, or a job downloading it."""
        remember_hub(d, key, hub)
        if (info := await _thread(entries.info, key, touch=True)) is not None:
            metrics.cache_hits.inc()
            d.grant(key, caller)
            return await _ready(info, service.job(key), reason, body.engine, hub)
        metrics.cache_misses.inc()
        with _reserved(caller, key):  # (its queue limit; nothing of a source to check)
            d.grant(key, caller)
            job = await service.ensure_job(key, Path(f"{body.source}@{body.revision}"), recipe, uid=caller.uid,
                                           alias=(body.source, str(body.revision)), fetch_only=True)
        return await _answer(key, job, reason, body.engine, hub)

    def _reserved(caller: Caller, key: str) -> contextlib.AbstractContextManager[Any]:
        """A place in the caller's limit of queued conversions (429 past it), taken before anything is awaited and
        held (``with``) until the job exists; nothing when the request joins the active job of ``key``."""
        job = service.job(key)
        if job is not None and job.active:
            return contextlib.nullcontext()
        return service.reserve(caller.uid, key, d.settings.max_queued_per_caller, caller.describe())  # (admins' too)

    @contextlib.asynccontextmanager
    async def _admitted(reader: Reader, key: str, source: str, body: CheckpointRequest, recipe: Recipe, *,
                        identity: SourceIdentity | None = None, slot: str | None = None) -> AsyncIterator[Any]:
        """Around the start of a job for ``key`` (unless the request joins the active one): a place in the caller's
        limit of queued conversions (:func:`_reserved`), then the engine's check of the converted checkpoint (from
        the headers of the files the request identified, in a source slot; 422; with no engine named, refused if one
        would load it wrong without an error). Yields the plan that check read (for the job), or None."""
        caller = reader.caller
        job = service.job(key)
        joins = job is not None and job.active
        with _reserved(caller, key):
            planned = None
            if body.engine is None and not joins:  # refused if an engine would load it wrong, without an error
                async with d.source_slot(caller):  # (config.json and the tensor names: the conversion plans it once)
                    refusal = await _thread(unnamed_refusal_of, d.cache, source, reader)
                if refusal is not None:
                    raise ApiError(422, "engine_needed", refusal)
            elif body.engine != "raw" and not joins:
                async with d.source_slot(caller):  # (it reads the source's headers)
                    planned, report = await _thread(plan_readiness, d, source, recipe, reader, identity=identity,
                                                    slot=slot)
                check_engine(report, body.engine)
            yield planned

    async def _answer(key: str, job: Any, reason: str | None, engine: str | None, hub: dict[str, Any]) -> Response:
        """POST's answer once the request has a job for ``key``: the entry (200) if the job is done, else 202."""
        if job.state == "ready":
            info = await _thread(entries.info, key)
            if info is not None:
                return await _ready(info, job, reason, engine, hub)
        return _accepted({**job_view(job), "target_reason": reason, **hub})

    async def _ready(info: Any, job: Any, reason: str | None, engine: str | None, hub: dict[str, Any]) -> Response:
        report = await _thread(d.entry_readiness, info.key, info.path)
        check_engine(report, engine)
        return _json({**entry_view(info, job), "target_reason": reason, "readiness": report, **hub})

    @app.get(
        "/v1/checkpoints/{key}",
        response_model=CheckpointInfo,
        summary="State of a conversion: queued, converting (with progress), ready (with path) or failed",
        responses=_errors(400, 404),
        tags=["checkpoints"],
    )
    async def get_checkpoint(key: KeyParam, request: Request, wait: WaitParam = 0.0) -> Response:
        check_key(key)
        await authorize(request, key)
        job = service.job(key)
        if job is not None and job.active and wait > 0:
            await job.wait_ended(wait)
        if job is not None and job.active:
            return _json(job_view(job))
        info = await _thread(entries.info, key)
        if info is not None:
            return _json({**entry_view(info, job), "readiness": await _thread(d.entry_readiness, info.key, info.path)})
        if job is not None and job.state == "failed":
            return _json(job_view(job))
        status = await _thread(cache.status, key)
        if status is not None and status.state == "ready":  # published since the lookup above
            info = await _thread(entries.info, key)
            if info is not None:
                return _json(entry_view(info, job))
        view = foreign_view(status) if status is not None else None
        if view is None:
            raise _unknown_key(key)
        return _json(view)

    @app.delete(
        "/v1/checkpoints/{key}",
        status_code=204,
        summary="Remove a cached conversion (409 while leased or converting)",
        responses=_errors(400, 404, 409),
        tags=["checkpoints"],
    )
    async def delete_checkpoint(key: KeyParam, request: Request) -> Response:
        check_key(key)
        caller = await authorize(request, key)
        job = service.job(key)
        if job is not None and job.active:  # (its creator is known once it is converted)
            raise ApiError(409, "conversion_in_progress", f"checkpoint {key} is being converted; delete it when ready")
        if not d.is_admin(caller) and d.creators.get(key) != caller.uid:
            raise ApiError(
                403,
                "not_owner",
                f"{caller.describe()} did not create checkpoint {key}: only the caller whose request converted it "
                "(or an admin) may delete it",
            )
        try:
            await anyio.to_thread.run_sync(cache.rm, key)
        except EntryNotFoundError:
            raise _unknown_key(key) from None
        except EntryLeasedError as e:
            raise error_for_exception(e) from None
        except Exception as e:
            raise error_for_exception(e) from e
        entries.forget(key)
        with contextlib.suppress(Exception):
            await anyio.to_thread.run_sync(d.refresh_gauges)
        return Response(status_code=204)

    @app.get(
        "/v1/checkpoints/{key}/files",
        response_model=FilesResponse,
        summary="The mmap API: every shard with its absolute path and tensor table (absolute byte offsets)",
        responses={202: {"description": "converting, no shard known yet (ask again)"}, **_errors(400, 404, 409)},
        tags=["files"],
    )
    async def get_files(key: KeyParam, request: Request) -> Response:
        check_key(key)
        await authorize(request, key)
        job = service.job(key)
        if job is not None and job.active:  # (no shard known yet, before its plan: a 202 too, never an empty 200)
            table = {**await _thread(job_files, entries, job), **d.hub_origins.get(key, {})}
            return _json(table) if table["files"] else _json(table, 202, {"Retry-After": "1"})
        info = await _thread(entries.info, key, touch=True)
        if info is not None:
            return Response(with_hub(await _thread(entries.body, info), d, key), media_type="application/json")
        return await _not_ready(key, job, files=True)

    @app.get(
        "/v1/checkpoints/{key}/files/{name}",
        response_model=FileModel,
        summary="Metadata of one shard (path, size, digest, tensor table; not its bytes: map the path); 202 (ready "
        "false) while it is not written yet, and the conversion moves it to the front",
        responses={202: {"model": FileModel, "description": "not written yet; requested"}, **_errors(400, 404, 409)},
        tags=["files"],
    )
    async def get_file(key: KeyParam, name: NameParam, request: Request) -> Response:
        check_key(key)
        check_file_name(name)
        await authorize(request, key)
        job = service.job(key)
        if job is not None and job.active:
            obj = await _thread(job_file, entries, job, name)
            if obj is None:
                raise ApiError(404, "unknown_file", f"checkpoint {key} has no shard {name}")
            if obj["ready"]:
                return _json(obj)
            job.priority.request(name)
            return _json(obj, 202, {"Retry-After": "1"})
        info = await _thread(entries.info, key, touch=True)
        if info is not None:
            data = await _thread(entries.body, info, name)
            if data is None:
                raise ApiError(404, "unknown_file", f"checkpoint {key} has no shard {name}")
            return Response(data, media_type="application/json")
        return await _not_ready(key, job, files=False, name=name)

    async def _not_ready(key: str, job: Any, *, files: bool, name: str | None = None) -> Response:
        if job is not None and job.state == "failed" and job.error is not None:
            raise ApiError(409, "conversion_failed", f"the conversion of {key} failed: {job.error.message}")
        status = await _thread(cache.status, key)
        view = foreign_view(status) if status is not None else None
        if view is None:
            raise _unknown_key(key)
        if view["state"] == "failed":
            raise ApiError(409, "conversion_failed", f"the conversion of {key} failed: {view['error']['message']}")
        if files:  # converting in another process: nothing is known of its shards here (not a 200: an empty table)
            return _json({"key": key, "state": "converting", "files": []}, 202, {"Retry-After": "1"})
        final = entries.final_dir(key) / (name or "")
        return _json(
            {
                "name": name,
                "path": None,
                "final_path": str(final),
                "size": None,
                "digest": None,
                "ready": False,
                "tensors": {},
            },
            202,
            {"Retry-After": "1"},
        )

    @app.post(
        "/v1/checkpoints/{key}/leases",
        response_model=LeaseModel,
        status_code=201,
        summary="Protect a ready entry from eviction until the lease expires or is released",
        responses=_errors(400, 404, 409, 413),
        tags=["leases"],
    )
    async def post_lease(key: KeyParam, request: Request, body: LeaseRequest | None = None) -> Response:
        check_key(key)
        caller = await authorize(request, key)
        longest = d.settings.max_ttl_of(d.is_admin(caller))  # (a reader's lease pins an entry for a bounded time)
        body = body or LeaseRequest(ttl_s=min(d.settings.default_lease_ttl_s, longest))
        if body.ttl_s > longest:
            raise ApiError(
                400,
                "bad_ttl",
                f"ttl_s {body.ttl_s} is above the maximum of {longest:.0f} s for {caller.describe()}; renew instead",
            )
        job = service.job(key)
        if job is not None and job.active:
            raise ApiError(409, "conversion_in_progress", f"checkpoint {key} is still converting; lease it once ready")
        async with d.lease_turn(caller):  # (the count and the lease together: the cap holds under concurrency)
            held = await _thread(_live_leases_of, cache, caller.uid)  # (an admin's and root's leases are counted too)
            if held >= d.settings.max_leases_per_caller:
                raise ApiError(
                    429,
                    "too_many_leases",
                    f"{caller.describe()} already holds {held} live leases (at most "
                    f"{d.settings.max_leases_per_caller} per caller); release some (DELETE .../leases/ID) first",
                    headers={"Retry-After": "60"},
                )
            try:
                lease = await anyio.to_thread.run_sync(
                    lambda: cache.acquire_lease(key, body.ttl_s, holder=body.holder, pid=None, uid=caller.uid)
                )
            except EntryNotFoundError:
                raise _unknown_key(key) from None
            except Exception as e:
                raise error_for_exception(e) from e
        return _json({"id": lease.id, "key": key, "expires_at": lease.expires_at, "holder": lease.holder}, 201)

    @app.delete(
        "/v1/checkpoints/{key}/leases/{lease_id}",
        status_code=204,
        summary="Release a lease",
        responses=_errors(400, 404),
        tags=["leases"],
    )
    async def delete_lease(key: KeyParam, lease_id: LeaseIdParam, request: Request) -> Response:
        check_key(key)
        caller = await authorize(request, key)
        if not LEASE_ID_RE.fullmatch(lease_id):
            raise ApiError(404, "unknown_lease", f"no lease {lease_id[:40]!r} (lease ids are 16 lowercase hex digits)")
        lease = await _thread(cache.get_lease, key, lease_id)
        mine = lease is not None and (lease.uid == caller.uid or d.is_admin(caller))
        released = mine and await _thread(cache.release_lease, lease_id, key)
        if not released:  # another caller's lease reads exactly like one that does not exist
            raise ApiError(404, "unknown_lease", f"no lease {lease_id} on checkpoint {key} (released or expired)")
        return Response(status_code=204)

    @app.get("/v1/cache", response_model=CacheModel, summary="Usage, budget and entries of the cache", tags=["cache"])
    async def get_cache(request: Request) -> Response:
        caller = d.caller(request)
        body = await _thread(_cache_view, d, caller)
        body["conversions"] = [
            {"key": j.key, "state": j.state, "source": str(j.source), "progress": j.progress.as_dict()}
            for j in service.active_jobs()
            if d.is_admin(caller) or d.may_see(j.key, caller)
        ]
        if service.tier is not None:
            body["remote"] = service.tier.as_dict()
        return _json(body)

    @app.get("/healthz", response_model=HealthModel, summary="Liveness and the daemon's configuration", tags=["daemon"])
    async def healthz() -> Response:
        from .. import __version__

        problems = await anyio.to_thread.run_sync(_health_problems, cache, limiter=d.health_limiter())
        if service.closing:
            problems.append("shutting down")
        body = {
            "status": "degraded" if problems else "ok",
            "version": __version__,
            "cache_root": str(cache.root),
            "device": d.device,
            "platform": d.platform.as_dict(),
            "caller_reads": caller_reads(),
            "problems": problems,
        }
        return _json(body, 503 if problems else 200)

    @app.get("/metrics", summary="Prometheus metrics", tags=["daemon"], response_class=Response)
    async def get_metrics() -> Response:
        if time.monotonic() - d.gauges_at > GAUGE_REFRESH_S:
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(d.refresh_gauges)
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _live_leases_of(cache: Cache, uid: int) -> int:
    now = time.time()
    return sum(1 for lease in cache.leases() if lease.uid == uid and lease.is_live(now))


def _cache_view(d: Daemon, caller: Caller | None = None) -> dict[str, Any]:
    """The cache as ``caller`` may see it: an admin everything; others the entries they may be served, with
    their own leases only (lease ids are capabilities to release)."""
    admin = caller is None or d.is_admin(caller)
    usage = d.cache.usage()
    now = time.time()
    leases: dict[str, list[dict[str, Any]]] = {}
    for lease in d.cache.leases():
        if lease.is_live(now) and (admin or lease.uid == caller.uid):
            leases.setdefault(lease.key, []).append(
                {"id": lease.id, "key": lease.key, "expires_at": lease.expires_at, "holder": lease.holder}
            )
    out = []
    for e in d.cache.entries():
        if not admin and not d.may_see(e.key, caller):
            continue
        info = d.entries.info(e.key)
        out.append(
            {
                "key": e.key,
                "size_bytes": info.size_bytes if info else 0,
                "last_used": e.last_used,
                "source": info.source if info else None,
                "recipe": info.recipe if info else None,
                "leases": leases.get(e.key, []),
            }
        )
    return {
        "root": str(usage.root),
        "usage_bytes": usage.used_bytes,
        "budget_bytes": usage.budget_bytes,
        "free_bytes": usage.free_bytes,
        "entries": out,
    }


def _health_problems(cache: Cache) -> list[str]:
    problems = []
    for d in (cache.entries_dir, cache.staging_dir):
        if not d.is_dir():
            problems.append(f"cache directory {d} is missing")
        elif not os.access(d, os.W_OK | os.X_OK):
            problems.append(f"cache directory {d} is not writable by the daemon")
    return problems
