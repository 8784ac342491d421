"""JSON bodies of checkpoint states: from a job of this daemon, a published entry, or the cache's status files.

Blocking helpers (``job_files``, ``job_file``) read shard headers: call them from a worker thread.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..cache import ConversionStatus
from ..safetensors_io import CheckpointError
from ..errors import is_invalid_input
from .errors import ApiError
from .files import EntryIndex, EntryInfo, file_object
from ..progress import Progress
from .service import FINISHED_TTL_S, Job
from .shards import is_shard_file


def urls(key: str) -> dict[str, str]:
    return {"status_url": f"/v1/checkpoints/{key}", "files_url": f"/v1/checkpoints/{key}/files"}


def _base(key: str, state: str) -> dict[str, Any]:
    return {
        "key": key,
        "state": state,
        "path": None,
        **urls(key),
        "size_bytes": None,
        "recipe": None,
        "source": None,
        "progress": None,
        "error": None,
        "timings": None,
    }


def entry_view(info: EntryInfo, job: Job | None = None) -> dict[str, Any]:
    """A ready entry (``job``: this daemon's finished job of it, for its progress record)."""
    out = _base(info.key, "ready")
    if job is not None and job.state == "ready":
        progress = job.progress.as_dict()
    else:
        progress = Progress("done", updated_at=info.created_at).as_dict()
    out.update(
        path=str(info.path),
        size_bytes=info.size_bytes,
        recipe=info.recipe,
        source=info.source,
        progress=progress,
        timings=info.timings,
    )
    return out


def passthrough_view(source: str, why: str) -> dict[str, Any]:
    """Target auto on a GPU with native MX instructions: the source itself is the answer (nothing converted)."""
    out = _base("passthrough", "ready")
    out.update(path=source, source=source, target_reason=why, progress=Progress("done").as_dict())
    return out


def job_view(job: Job) -> dict[str, Any]:
    """A job of this daemon: queued, converting or failed (a ready job is shown through its entry)."""
    out = _base(job.key, job.state)
    out.update(
        recipe=job.recipe.as_dict(),
        source=str(job.source),
        progress=job.progress.as_dict(),
        error=job.error.body() if job.error is not None else None,
    )
    if job.state == "ready" and job.entry_path is not None:
        out["path"] = str(job.entry_path)
    return out


def foreign_view(status: ConversionStatus) -> dict[str, Any] | None:
    """A conversion of another process (or an earlier run) as the cache's status files show it; None if stale."""
    if status.state in ("converting", "downloading", "publishing"):  # (downloading: from the remote tier)
        out = _base(status.key, "converting")
        reported = status.progress if status.state != "publishing" else None
        out.update(
            source=status.source,
            progress=(reported or Progress()).replace(
                phase=status.state,
                updated_at=status.updated_at,
            ).as_dict(),
        )
        return out
    if status.state == "failed":
        if status.updated_at is not None and time.time() - status.updated_at > FINISHED_TTL_S:
            return None
        out = _base(status.key, "failed")
        invalid = is_invalid_input(status.error_type)
        err = ApiError(
            422 if invalid else 500,
            "invalid_checkpoint" if invalid else "conversion_failed",
            f"{status.error_type}: {status.error}",
        )
        out.update(error=err.body(), progress=Progress("failed", updated_at=status.updated_at).as_dict())
        return out
    return None


def job_file(
    entries: EntryIndex, job: Job, name: str, finished: dict[str, Path] | None = None
) -> dict[str, Any] | None:
    """The file object of shard ``name`` of a running job; None when the job's checkpoint has no such shard."""
    finished = job.priority.finished() if finished is None else finished
    known = job.outline.shards if job.outline is not None else ()
    if name not in known and name not in finished and (job.outline is not None or not is_shard_file(name)):
        return None
    final = entries.final_dir(job.key) / name
    written = finished.get(name)
    if written is not None:
        candidates = [written]
        if job.staging_dir:
            candidates.append(Path(job.staging_dir) / "checkpoint" / name)  # after the converter's own rename
        candidates.append(final)  # after the cache's publish
        for path in candidates:
            try:
                return file_object(name, path=path, final_path=final, ready=True)
            except (CheckpointError, OSError):
                continue
    return file_object(name, path=None, final_path=final, ready=False)


def job_files(entries: EntryIndex, job: Job) -> dict[str, Any]:
    """``/files`` of a running job: every shard known so far (from the plan, or reported finished)."""
    finished = job.priority.finished()
    names = list(job.outline.shards) if job.outline is not None else []
    names += [n for n in finished if n not in names]
    files = [f for f in (job_file(entries, job, n, finished) for n in names) if f is not None]
    return {"key": job.key, "state": job.state, "files": files}
