"""Request and response bodies of the HTTP API (pydantic models; they make FastAPI's OpenAPI schema)."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..hub import MAX_REVISION_CHARS, REPO_ID_PATTERN, REVISION_PATTERN
from ..progress import Progress
from ..selectre import MAX_SELECT_CHARS

State = Literal["queued", "converting", "ready", "failed"]

#: Longest ``holder`` of a lease.
MAX_HOLDER_CHARS = 200
#: Longest ``source`` path (the same as :data:`transformd.daemon.paths.MAX_PATH_CHARS`).
MAX_SOURCE_CHARS = 4096


class CheckpointRequest(BaseModel):
    """Resolve a source checkpoint: return the cached conversion, or start (or join) one."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        ...,
        description="absolute path of the MXFP8 checkpoint directory, under an allowed root; or a Hugging Face "
        "repo id namespace/name, looked up in the daemon's hub cache (see revision; transformd.hub)",
        # documented here, checked by the app (paths.SourcePolicy.check_syntax) with a message naming the problem
        json_schema_extra={
            "minLength": 1, "maxLength": MAX_SOURCE_CHARS, "pattern": "^/[^\\u0000]*$|" + REPO_ID_PATTERN
        },
    )
    revision: str | None = Field(
        None,
        max_length=MAX_REVISION_CHARS,
        description="with a repo id: a branch or tag the hub cache recorded, or a full commit hash (default main); "
        "with a path: 422",
        json_schema_extra={"pattern": REVISION_PATTERN},
    )
    target: Literal["auto", "fnuz", "ocp"] = Field(
        "auto",
        description="auto: chosen for engine and this node's GPU (ocp for vllm/sglang/transformers; for raw "
        "consumers fnuz on gfx94x, else ocp; the MXFP8 source itself on GPUs with native MX); fnuz: e4m3fnuz "
        "(gfx94x); ocp: e4m3fn",
    )
    engine: Literal["vllm", "sglang", "transformers", "raw"] | None = Field(
        None,
        description="who loads the output: picks the target for auto (sglang: fused expert stacks are written per "
        "expert), and a checkpoint that engine could not load at any tensor-parallel size is refused (422 "
        "engine_cannot_load); none: a checkpoint some engine would load wrong without an error is refused (422 "
        "engine_needed; raw: no check)",
    )
    scale_mode: Literal["exact", "amax"] = Field("exact", description="exact: power-of-two tile scales; amax: /448")
    select: str | None = Field(
        None,
        max_length=MAX_SELECT_CHARS,
        description="convert only MXFP8 weights whose name matches (an RE2 search, linear time; RE2 has no "
        "lookaround, backreferences, atomic groups or possessive repeats: such a pattern is refused, 422 bad_select, "
        "naming what RE2 lacks)",
        json_schema_extra={"format": "regex"},
    )


class HubModel(BaseModel):
    """A repo id source: what was asked for, and the snapshot directory of the hub cache it resolved to."""

    repo_id: str
    revision: str = Field(..., description="as asked for (default main)")
    commit: str = Field(..., description="the commit hash of the snapshot")
    snapshot: str = Field(..., description="the snapshot directory converted (the source)")


class RecipeModel(BaseModel):
    target: str
    scale_mode: str
    select: str | None = None
    format_version: int


class ErrorBody(BaseModel):
    status: int
    code: str = Field(..., description="stable machine-readable code, e.g. invalid_checkpoint, source_not_allowed")
    message: str = Field(..., description="what went wrong and what to do, for a person")


class ErrorResponse(BaseModel):
    error: ErrorBody


#: What the API says of each :class:`~transformd.progress.Progress` field (the model is built from the record itself,
#: so the schema and the record cannot drift apart).
_PROGRESS_DOCS = {
    "phase": "validating, queued, converting, downloading (from the remote tier), waiting (another process converts), "
    "publishing, done, failed",
    "shard": "the shard the converter reported last",
    "bytes_done": "input bytes converted so far",
    "convert_bytes_done": "MXFP8 weight bytes converted so far (the slow part; the ETA comes from these)",
    "eta_s": "estimated seconds left",
}
ProgressModel = create_model(
    "ProgressModel",
    **{name: (hint, Field(None, description=_PROGRESS_DOCS.get(name)))
       for name, hint in typing.get_type_hints(Progress).items()},
)


class CheckpointInfo(BaseModel):
    """A checkpoint's conversion: ready (with ``path``), queued or converting (with ``progress``), or failed."""

    key: str = Field(..., description="cache key: 32 hex digits of the source content and the recipe")
    state: State
    path: str | None = Field(None, description="the converted checkpoint directory (ready only): give it to the engine")
    files_url: str
    status_url: str
    size_bytes: int | None = Field(None, description="bytes of the entry on disk (ready only)")
    recipe: RecipeModel | None = None
    source: str | None = Field(None, description="the source path it was converted from")
    hub: HubModel | None = Field(None, description="the repo id asked for and its snapshot (repo id sources only)")
    progress: ProgressModel | None = None
    error: ErrorBody | None = Field(None, description="why it failed (failed only)")
    timings: dict[str, float] | None = Field(None, description="seconds per phase of the conversion (ready only)")
    target_reason: str | None = Field(None, description="why this target (or no conversion) was chosen")
    readiness: dict[str, dict] | None = Field(
        None,
        description="per engine (vllm, sglang, transformers): loads_at (tensor-parallel sizes), problems (every "
        "reason, with its TP sizes), warnings, may_load_at and conditions (TP sizes it may load at, and how), "
        "misloads (problems it loads with, wrongly, without an error), rules_from (the engine releases the rules "
        "were read from and checked against) (ready only)",
    )


class TensorModel(BaseModel):
    dtype: str = Field(..., description="safetensors dtype, e.g. F8_E4M3FNUZ, F32, BF16")
    shape: list[int]
    offsets: list[int] = Field(..., min_length=2, max_length=2, description="[begin, end): absolute byte positions")


class FileModel(BaseModel):
    name: str
    path: str | None = Field(
        None,
        description="absolute path to open and map (null: not written yet); while converting it may be in the "
        "staging directory: open it at once, it is renamed into final_path with the same inode",
    )
    final_path: str = Field(..., description="where the file lives once the entry is published")
    size: int | None = None
    digest: str | None = Field(None, description="blake3 digest from the manifest (null until published)")
    ready: bool
    tensors: dict[str, TensorModel] = Field(default_factory=dict)


class FilesResponse(BaseModel):
    key: str
    state: State
    files: list[FileModel]
    hub: HubModel | None = Field(None, description="the repo id this key was last asked for by, and its snapshot")


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(3600.0, gt=0, description="seconds until the lease expires (at most the daemon's maximum)")
    holder: str = Field("", max_length=MAX_HOLDER_CHARS, description="who holds it, e.g. 'vllm node-3 rank 0'")


class LeaseModel(BaseModel):
    id: str
    key: str
    expires_at: float
    holder: str = ""


class CacheEntryModel(BaseModel):
    key: str
    size_bytes: int
    last_used: float
    source: str | None = None
    recipe: RecipeModel | None = None
    leases: list[LeaseModel] = Field(default_factory=list, description="live leases")


class ConversionModel(BaseModel):
    key: str
    state: State
    source: str
    progress: ProgressModel


class CacheModel(BaseModel):
    root: str
    usage_bytes: int
    budget_bytes: int
    free_bytes: int
    entries: list[CacheEntryModel]
    conversions: list[ConversionModel] = Field(default_factory=list, description="conversions of this daemon")
    remote: dict | None = Field(None, description="the remote tier (--remote): url, read_only, and its counts since "
                                "the daemon started: hits, misses, bytes, verification_failures, failures, uploads, "
                                "upload_failures")


class HealthModel(BaseModel):
    status: Literal["ok", "degraded"]
    version: str
    cache_root: str
    device: str
    platform: dict | None = Field(None, description="the GPU target auto decides for: vendor, arch, fnuz, mx_native")
    caller_reads: str | None = Field(None, description="how a caller's right to read a source is enforced: 'kernel: "
                                     "...' (its own file-system credentials) or 'checks: ...' (mode bits compared)")
    problems: list[str] = Field(default_factory=list)
