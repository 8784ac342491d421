"""A mutation pass: plant small bugs in a copy of the package and check that the relevant tests fail.

Each mutant (:data:`MUTANTS`) replaces one exact piece of source text in a temporary copy of ``transformd/`` and
``tests/`` (the working tree is never touched), then runs the test files that should catch it there
(``python -m pytest -x -q FILES``, with the copy first on ``PYTHONPATH``). A mutant is *killed* when the tests
fail and *survives* when they pass; a survivor is either a hole in the tests or a change the contract allows
(its ``note`` says which). The modules covered are the ones that decide bytes and trust: ``formats.py`` and
``mx.py``, the host code of ``kernels.py``, ``reference.py``, ``numpy_exact.py``, ``cache/keys.py``, the source policy
(``cache/securefs.py``, ``daemon/paths.py``) and the publish paths (``_durable.py``, ``checkpoint/convert.py``,
``cache/store.py`` seal/publish, ``cache/seal.py``, ``cache/manifest.py``, ``safetensors_io.py``'s writer) and
converting while hashing (``cache/alongside.py``, and the daemon's first resolve in ``daemon/app.py`` and
``daemon/service.py``), and the remote tier's checks of what it fetches (``remote/fetch.py``, ``remote/names.py``,
``remote/publish.py``).

The GPU-only mutants (the PTX kernel, the ptx/portable choice) can only be caught on CPU by
tests/test_gpu_record.py's digest check. When the copy has no tests/gpu/last_run.json, the runner writes one that
records the *unmutated* sources' digest (device "simulated by the mutation pass"), as a committed GPU run would, so
that check is exercised; the working tree's record, if any, is used as it is.

Usage (from the repository root; about 10-15 minutes on 2 cores for the whole list)::

    .venv/bin/python tests/mutation/run_mutants.py            # every mutant, then the table
    .venv/bin/python tests/mutation/run_mutants.py --list     # ids only
    .venv/bin/python tests/mutation/run_mutants.py --only fsync-noop-everywhere paths-string-prefix

Exit status 0 when every mutant not marked ``expected_survivor`` was killed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

KERNEL_TESTS = ["tests/test_kernels.py", "-k", "oracle or tile_grid or fnuz or pr45726 or lossless or invalid or "
                "two_dimensional or shapes or dtypes or kernel_matches_reference_random"]
KEY_TESTS = ["tests/test_cache_keys.py"]
PATH_TESTS = ["tests/test_api_paths.py", "tests/test_daemon_hostile.py"]
DURABILITY_TESTS = ["tests/test_durability.py"]
GPU_RECORD = ["tests/test_gpu_record.py", "-k", "covers"]
ALONGSIDE_TESTS = ["tests/test_cache_alongside.py", "tests/test_cache_processes.py"]
DAEMON_ALONGSIDE_TESTS = ["tests/test_daemon_alongside.py"]
NUMPY_TESTS = ["tests/test_numpy_exact.py"]
#: The tests of a source swapped after its check, of keys from a user namespace, of trickling connections.
SWAP_TESTS = ["tests/test_trust_callers.py", "-k", "swapped"]
NAMESPACE_TESTS = ["tests/test_cache_keys.py", "-k", "namespace"]
TRICKLE_TESTS = ["tests/test_trust_freezes.py", "-k", "trickling"]
WALK_TESTS = ["tests/test_trust_callers.py", "-k", "cannot_search"]
#: Issue 42's second trust round: select, caps, the client, the listener, the planted bugs.
HOLD_TESTS = ["tests/test_trust_holds.py", "-k", "re2_only"]
CAP_TESTS = ["tests/test_trust_caps.py"]
CLIENT_TRUST_TESTS = ["tests/test_client_trust.py"]
LISTENER_TESTS = ["tests/test_trust_listener.py"]
PLANTED_TESTS = ["tests/test_trust_planted.py"]
#: The tests of answers about what a caller may not read (issue 42, item 3 and 4), and of the borrowed credentials.
ORACLE_TESTS = ["tests/test_trust_oracles.py", "-k", "links_into or exchanged"]
FSCREDS_TESTS = ["tests/test_trust_fscreds.py"]
REMOTE_TESTS = ["tests/test_remote.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    count: int = 1  # occurrences of ``old`` replaced (-1: all, at least one)
    expected_survivor: bool = False
    note: str = ""


def m(id: str, file: str, old: str, new: str, tests: list[str], **kw) -> Mutant:
    return Mutant(id, file, old, new, tuple(tests), **kw)


MUTANTS: list[Mutant] = [
    # -- formats.py, mx.py ----------------------------------------------------------------------------------------
    m("tile-grid-off-by-one", "transformd/formats.py", "return -(-n // TILE), -(-k // TILE)",
      "return n // TILE + 1, k // TILE + 1", KERNEL_TESTS),
    m("k-multiple-of-32-unchecked", "transformd/formats.py", "    if k % MX_BLOCK:\n", "    if False:\n", KERNEL_TESTS),
    m("nan-code-unchecked", "transformd/mx.py", "if bool(nan_code.any()):", "if False:", KERNEL_TESTS),
    m("e8m0-nan-unchecked", "transformd/mx.py", "nan_scale = s == E8M0_NAN", "nan_scale = s == 0xFE",
      KERNEL_TESTS),
    m("e8m0-subnormal-scale", "transformd/mx.py", "torch.full_like(s, 1 << 22)", "torch.full_like(s, 0)",
      KERNEL_TESTS),
    m("fnuz-dtype-swapped", "transformd/formats.py",
      "return torch.float8_e4m3fnuz if self is Target.FNUZ else torch.float8_e4m3fn",
      "return torch.float8_e4m3fn", KERNEL_TESTS),
    # -- kernels.py: host code (the wrapper) and the kernels' source --------------------------------------------------
    m("kernel-fnuz-flag-dropped", "transformd/kernels.py", "FNUZ=target is Target.FNUZ,", "FNUZ=False,",
      KERNEL_TESTS, count=-1),
    m("kernel-mode-flag-inverted", "transformd/kernels.py", "EXACT=scale_mode is ScaleMode.EXACT,",
      "EXACT=scale_mode is ScaleMode.AMAX,", KERNEL_TESTS, count=-1),
    m("kernel-status-not-checked", "transformd/kernels.py", "if check and bool(status.any()):", "if False:",
      KERNEL_TESTS),
    m("kernel-2d-not-squeezed", "transformd/kernels.py", "return out_codes[0], out_scale[0]",
      "return out_codes, out_scale", KERNEL_TESTS),
    m("ptx-fnuz-fix-dropped", "transformd/kernels.py", "_PTX_MUL_FNUZ = _ptx(_PTX_MUL, _PTX_SIGN_FNUZ)",
      "_PTX_MUL_FNUZ = _ptx(_PTX_MUL, _PTX_SIGN_OCP)", GPU_RECORD,
      note="the PTX kernel runs only on a GPU: caught by the digest of the last GPU run"),
    m("ptx-alignment-fallback-weakened", "transformd/kernels.py", "codes.data_ptr() % 16 or out_codes.data_ptr() % 16",
      "codes.data_ptr() % 4 or out_codes.data_ptr() % 4", GPU_RECORD,
      note="host code of the ptx path: no CPU test can launch ptx; caught by the digest"),
    m("grouped-expert-row-dropped", "transformd/kernels.py",
      "row = table_ptr + tl.program_id(2).to(tl.int64) * 8", "row = table_ptr",
      ["tests/test_kernels.py", "-k", "grouped or packed"]),
    m("portable-kernel-fnuz-zero-sign", "transformd/kernels.py",
      "sign = tl.where(code == 0, 0, sign)  # -0 is NaN in FNUZ: write +0", "pass", KERNEL_TESTS),
    # -- reference.py ------------------------------------------------------------------------------------------------
    m("reference-fnuz-fix-dropped", "transformd/reference.py",
      "codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)", "pass", KERNEL_TESTS),
    m("reference-exact-scale-boundary", "transformd/reference.py", "mant <= 0.875", "mant < 0.875", KERNEL_TESTS),
    m("reference-amax-not-abs", "transformd/reference.py", "torch.nn.functional.pad(v.abs(),",
      "torch.nn.functional.pad(v,", KERNEL_TESTS),
    m("reference-amax-scalar-division", "transformd/reference.py", "amax / torch.full_like(amax, E4M3FN_MAX)",
      "amax / E4M3FN_MAX", KERNEL_TESTS, expected_survivor=True,
      note="identical on the CPU (IEEE there); differs only on CUDA, where the GPU suite compares with the oracle"),
    m("reference-fnuz-scale-not-doubled", "transformd/reference.py", "return codes, scale * 2", "return codes, scale",
      KERNEL_TESTS),
    # -- numpy_exact.py: the CPU path's and the head start's lookups --------------------------------------------------
    m("numpy-block-maxima-16-wide", "transformd/numpy_exact.py", "while shift < MX_BLOCK:",
      "while shift < MX_BLOCK // 2:", NUMPY_TESTS),
    m("numpy-tile-amax-half-tiles", "transformd/numpy_exact.py", "np.arange(0, n, TILE)", "np.arange(0, n, TILE // 2)",
      NUMPY_TESTS),
    m("numpy-exact-scale-boundary", "transformd/numpy_exact.py", "mant <= 0.875", "mant < 0.875", NUMPY_TESTS),
    m("numpy-fnuz-table-swapped", "transformd/numpy_exact.py", "return table(fnuz)", "return table(not fnuz)",
      NUMPY_TESTS),
    m("numpy-amax-reciprocal-multiply", "transformd/numpy_exact.py", "amax / np.float32(E4M3FN_MAX))",
      "amax * np.float32(1 / E4M3FN_MAX))", NUMPY_TESTS),
    m("numpy-amax-rounding-ties-away", "transformd/numpy_exact.py",
      "rounded = bits + 0x7FFFF + ((bits >> 20) & 1)", "rounded = bits + 0x80000", NUMPY_TESTS),
    m("numpy-amax-one-table-short", "transformd/numpy_exact.py",
      "width = int(above.max(initial=-1, where=matters)) + 1",
      "width = max(1, int(above.max(initial=-1, where=matters)))", NUMPY_TESTS),
    m("numpy-amax-zero-table-threshold-doubled", "transformd/numpy_exact.py", "* 2.0**-10, n, groups)",
      "* 2.0**-9, n, groups)", NUMPY_TESTS),
    m("numpy-amax-zero-table-unsigned", "transformd/numpy_exact.py", "[0, 0 if fnuz else 0x80]", "[0, 0]",
      NUMPY_TESTS),
    m("numpy-amax-pieces-skip-tiles", "transformd/numpy_exact.py", "for t0 in range(0, tiles, step):",
      "for t0 in range(0, tiles, step + 1):", NUMPY_TESTS),
    m("convert-weight-cpu-fnuz-dropped", "transformd/convert.py", "fnuz=target is Target.FNUZ, out=out3[e]",
      "fnuz=False, out=out3[e]", NUMPY_TESTS),
    m("cpu-reference-values-unchecked", "transformd/convert.py",
      "    problem = find_value_problem(codes, scales)\n    if problem:", "    problem = None\n    if problem:",
      ["tests/test_pipeline.py", "-k", "cpu_invalid"]),
    # -- cache/keys.py -----------------------------------------------------------------------------------------------
    m("key-ignores-tokenizer-content", "transformd/cache/keys.py", "        records.append(FileRecord(rel, st.st_size, digest))",
      "        records.append(FileRecord(rel, st.st_size, 'x' if rel == 'tokenizer.json' else digest))", KEY_TESTS),
    m("key-ignores-non-shard-content", "transformd/cache/keys.py",
      "        records.append(FileRecord(rel, st.st_size, digest))",
      "        records.append(FileRecord(rel, st.st_size, digest if rel.endswith('.safetensors') else ''))", KEY_TESTS),
    m("key-ignores-recipe-select", "transformd/cache/keys.py", '"select": self.select,', "", KEY_TESTS),
    m("key-ignores-format-version", "transformd/cache/keys.py", '"format_version": self.format_version,', "",
      KEY_TESTS),
    m("key-drops-file-size", "transformd/cache/keys.py", "return [[f.name, f.size, f.digest] for f in self.files]",
      "return [[f.name, f.digest] for f in self.files]", KEY_TESTS, expected_survivor=True,
      note="equivalent: the content digest already determines the size"),
    m("hashing-alongside-on-every-core", "transformd/cache/keys.py",
      "hash_file(f.proc_path, paced, background=pace is not None)", "hash_file(f.proc_path, paced)",
      ["tests/test_cache_alongside.py", "-k", "few_threads"]),
    m("key-ignores-writers", "transformd/cache/keys.py", '           "writers": list(identity.writers)}', "}",
      ["tests/test_cache_keys.py", "-k", "rewrite"]),
    m("writers-not-translated", "transformd/cache/writers.py",
      "    return None if ranges == _IDENTITY else ranges", "    return None", NAMESPACE_TESTS),
    m("writers-overflow-id-trusted", "transformd/cache/writers.py", "    if n == _overflow_id(kind):", "    if False:",
      NAMESPACE_TESTS),
    # -- a source swapped after its check (daemon/service.py, daemon/app.py) --------------------------------------------
    m("keyed-job-files-unchecked", "transformd/request.py",
      "expect_files=identity if slot is None and key is not None else None,", "expect_files=None,",
      SWAP_TESTS),
    m("provisional-job-tree-unchecked", "transformd/request.py", "expect_slot=slot,", "expect_slot=None,",
      SWAP_TESTS),
    m("readiness-reads-for-any-caller", "transformd/daemon/sources.py",
      "        missing = reader.denied(facts)\n", "        missing = None\n", SWAP_TESTS),
    # -- connections (daemon/peers.py, daemon/middleware.py) ------------------------------------------------------------
    m("connections-per-uid-unlimited", "transformd/daemon/peers.py",
      "if uid is not None and per_uid.get(uid, 0) >= max_per_uid:", "if False:",
      TRICKLE_TESTS),
    m("body-without-deadline", "transformd/daemon/middleware.py",
      "with anyio.move_on_after(self.timeout_s) as deadline:", "with anyio.move_on_after(None) as deadline:",
      TRICKLE_TESTS),
    m("next-request-without-header-deadline", "transformd/daemon/peers.py",
      "if cycle is not None and cycle.response_complete and self._td_armed_for is not cycle:", "if False:",
      ["tests/test_trust_freezes.py", "-k", "kept_alive"]),
    # -- this session's trust fixes (daemon/peers.py, app.py, middleware.py; client; convert --out) ---------------------
    m("path-walk-ancestors-unchecked", "transformd/daemon/peers.py",
      "    return denied(caller, AccessFacts((), (), tuple(facts)))", "    return None",
      WALK_TESTS),
    m("path-walk-not-asked", "transformd/daemon/app.py",
      "if not reader.kernel and (missing := await _thread(path_denied, caller, source, d.policy.allowed)) is not None:",
      "if (missing := None) is not None:", WALK_TESTS),
    m("path-walk-inside-unchecked", "transformd/daemon/peers.py",
      "    return _inside_denied(caller, path, allowed)", "    return None", WALK_TESTS),
    m("hub-cache-unchecked", "transformd/daemon/hub_sources.py",
      "if not reader.kernel and (missing := path_denied(caller, str(hub.cache_dir), listed=False)) is not None:",
      "if (missing := None) is not None:", ["tests/test_trust_callers.py", "-k", "hub_cache"],
      expected_survivor=True, note="a second layer since issue 42: without the caller's credentials the lookup itself "
      "asks whether the way to the repo's folder is the caller's to search (hub.resolve's hidden), and refuses the "
      "same callers with the same 403; with them, the kernel does"),
    # -- issue 42, items 3 and 4: the caller's own credentials, checks on descriptors (daemon/fscreds.py, peers.py,
    # cache/securefs.py, hub.py); the oracle tests run with the caller's credentials and without ------------------
    m("caller-credentials-not-taken", "transformd/daemon/fscreds.py",
      "        if not self.kernel or self.caller.uid == 0:\n            return contextlib.nullcontext()",
      "        if True:\n            return contextlib.nullcontext()", ORACLE_TESTS),
    m("caller-groups-for-every-thread", "transformd/daemon/fscreds.py", "        _set_groups(groups)\n",
      "        os.setgroups(groups)\n", FSCREDS_TESTS),
    m("kernel-refusal-not-the-one-answer", "transformd/cache/securefs.py",
      "if reader is not None and reader.kernel and e.errno in (errno.EACCES, errno.EPERM):", "if False:",
      ORACLE_TESTS),
    m("caller-check-after-sizing", "transformd/cache/securefs.py",
      "        reader.check(tree)  # (before anything is taken", "        pass  # (", ORACLE_TESTS),
    m("unopenable-entry-not-asked", "transformd/cache/securefs.py",
      "    missing = reader.hides(path)\n", "    missing = None\n", ORACLE_TESTS),
    m("way-walk-follows-links-unseen", "transformd/daemon/peers.py",
      "_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC", "_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC", ORACLE_TESTS),
    m("hub-record-link-followed", "transformd/hub.py",
      "os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)",
      "os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)",
      ["tests/test_trust_oracles.py", "-k", "hub_records"]),
    m("hub-snapshot-link-not-asked", "transformd/hub.py",
      "    if hidden is not None and hidden(path):\n        raise PermissionError",
      "    if False:\n        raise PermissionError", ["tests/test_trust_oracles.py", "-k", "hub_records"]),
    m("cache-dirs-listable", "transformd/cache/store.py",
      "dir_with_mode(d, 0o711 if d in (self.entries_dir, self.staging_dir) else 0o700)", "dir_with_mode(d, 0o755)",
      ["tests/test_cache_store.py", "-k", "list_nothing"]),
    m("active-files-an-empty-200", "transformd/daemon/app.py",
      'return _json(table) if table["files"] else _json(table, 202, {"Retry-After": "1"})', "return _json(table)",
      ["tests/test_api_checkpoints.py", "-k", "knows_no_shard"]),
    m("method-label-unbounded", "transformd/daemon/middleware.py",
      'method = method if method in _METHODS else "other"', "method = method",
      ["tests/test_api_checkpoints.py", "-k", "made_up"]),
    m("foreign-files-an-empty-200", "transformd/daemon/app.py",
      '{"key": key, "state": "converting", "files": []}, 202, {"Retry-After": "1"})',
      '{"key": key, "state": "converting", "files": []})', ["tests/test_api_checkpoints.py", "-k", "another_process"]),
    m("answer-relative-path-trusted", "transformd/answers.py",
      'if not isinstance(path, str) or not path.startswith("/"):', "if not isinstance(path, str):",
      ["tests/test_client.py", "-k", "another_shape"]),
    m("second-writer-of-out-allowed", "transformd/checkpoint/convert.py",
      "            _refuse_a_second_writer(staging, out)\n", "", ["tests/test_cli.py", "-k", "second_convert"]),
    m("stat-cache-ignores-ctime", "transformd/cache/keys.py", "tuple(old[:5]) == sig", "tuple(old[:4]) == sig[:4]",
      KEY_TESTS),
    m("key-hashes-hidden-files", "transformd/cache/securefs.py",
      '        if name.startswith("."):\n            continue  # never read, never converted, not in the key',
      '        if False:\n            continue', KEY_TESTS),
    # -- the source policy: cache/securefs.py, daemon/paths.py ----------------------------------------------------------------------------
    m("paths-string-prefix", "transformd/cache/securefs.py",
      "return path == root or path.startswith(root.rstrip(os.sep) + os.sep)", "return path.startswith(root)",
      PATH_TESTS),
    m("paths-opened-file-outside-unchecked", "transformd/cache/securefs.py",
      "    if roots is not None and not any(within(real, r) for r in roots):\n        raise _outside(shown, roots)",
      "    if False:\n        raise _outside(shown, roots)", PATH_TESTS),
    m("paths-roots-not-resolved", "transformd/daemon/paths.py", "tuple(os.path.realpath(os.fspath(r)) for r in roots)",
      "tuple(os.path.abspath(os.fspath(r)) for r in roots)", PATH_TESTS),
    m("paths-missing-outside-probed", "transformd/cache/securefs.py",
      "            real = real_path(shown)\n            if real is None or not any(within(real, r) for r in roots):",
      "            real = real_path(shown)\n            if real is not None and os.path.exists(real) and not "
      "any(within(real, r) for r in roots):", PATH_TESTS),
    # -- the publish paths: fsync and rename ---------------------------------------------------------------------------
    m("fsync-noop-everywhere", "*", "os.fsync(", "(lambda fd: None)(", DURABILITY_TESTS, count=-1),
    m("seal-dir-fsync-dropped", "transformd/cache/store.py", "            os.chmod(d, 0o555)\n            fsync_path(d)",
      "            os.chmod(d, 0o555)", DURABILITY_TESTS),
    m("manifest-fsync-noop", "transformd/cache/manifest.py", "            os.fsync(fd)\n", "", DURABILITY_TESTS),
    m("cache-stage-fsync-dropped", "transformd/cache/store.py",
      '            fsync_path(stage)\n            self._hook("before-rename")',
      '            self._hook("before-rename")', DURABILITY_TESTS),
    m("cache-entries-dir-fsync-dropped", "transformd/cache/store.py",
      '            fsync_path(self.entries_dir)\n            self._hook("published")',
      '            self._hook("published")', DURABILITY_TESTS),
    m("writer-fsync-noop", "transformd/safetensors_writer.py", "            os.fsync(self._file.fileno())\n", "",
      DURABILITY_TESTS),
    m("checkpoint-synced-file-fsync-noop", "transformd/_durable.py",
      "        os.fsync(fd)\n        return os.fstat(fd).st_size", "        return os.fstat(fd).st_size",
      DURABILITY_TESTS),
    m("checkpoint-json-fsync-noop", "transformd/_durable.py", "        f.flush()\n        os.fsync(f.fileno())\n",
      "        f.flush()\n", DURABILITY_TESTS),
    m("checkpoint-tree-fsync-dropped", "transformd/checkpoint/convert.py",
      "            _durable.fsync_dirs(staging)\n            _durable.publish(", "            _durable.publish(",
      DURABILITY_TESTS),
    m("checkpoint-tree-fsync-parents-first", "transformd/_durable.py", "os.walk(path, topdown=False)",
      "os.walk(path, topdown=True)", DURABILITY_TESTS),
    m("checkpoint-parent-fsync-dropped", "transformd/_durable.py",
      "        raise\n    fsync_path(out.parent)\n", "        raise\n", DURABILITY_TESTS),
    m("checkpoint-staging-kept-on-error", "transformd/checkpoint/convert.py",
      "                head.cancel()  # (it writes into the staging directory)\n            shutil.rmtree(staging, "
      "ignore_errors=True)\n", "                head.cancel()  # (it writes into the staging directory)\n",
      ["tests/test_checkpoint.py"]),
    # -- issue 42, second round: entry names, admins, leases, damage after a serve --------------------------------------
    m("entry-named-by-its-key", "transformd/cache/names.py", 'name = f"{key}-{self._tag(key, create)}"',
      "name = key", ["tests/test_trust_names.py", "-k", "computes"]),
    m("old-entry-names-left", "transformd/cache/store.py", "            self._migrate_entry_names()\n", "",
      ["tests/test_trust_names.py", "-k", "earlier_layout"]),
    m("root-admin-by-default", "transformd/daemon/settings.py", "else frozenset({os.geteuid()})",
      "else frozenset({0, os.geteuid()})", ["tests/test_trust_admins.py", "-k", "named"]),
    m("admin-leases-uncounted", "transformd/daemon/app.py", "        held = await _thread(_live_leases_of, cache, caller.uid)",
      "        held = 0 if d.is_admin(caller) else await _thread(_live_leases_of, cache, caller.uid)",
      ["tests/test_trust_admins.py", "-k", "caps"]),
    m("reader-lease-unbounded", "transformd/daemon/settings.py",
      "return self.max_lease_ttl_s if admin else min(self.max_lease_ttl_s, self.max_caller_lease_ttl_s)",
      "return self.max_lease_ttl_s", ["tests/test_trust_admins.py", "-k", "own_leases"]),
    m("served-entry-unchecked", "transformd/daemon/files.py", "            problems = _stamp_problems(info.stamps)",
      "            problems = []", ["tests/test_trust_damage.py", "-k", "first_serve_is"]),
    # -- cache/seal.py: the output's digests taken while the conversion goes on -------------------------------------
    m("seal-early-digest-of-a-changed-file", "transformd/cache/seal.py",
      "return known[1] if known is not None and known[0] == _signature(st) else None",
      "return known[1] if known is not None else None", ["tests/test_cache_seal.py"]),
    m("seal-early-digest-of-an-incomplete-shard", "transformd/cache/seal.py",
      "            if before.st_size != self._declared[inode]:\n                return  # (still being written)\n",
      "", ["tests/test_cache_seal.py"]),
    m("seal-early-digests-unused", "transformd/cache/store.py", "digest = early.digest(p, st)", "digest = None",
      ["tests/test_cache_seal.py"]),
    m("seal-thread-not-stopped", "transformd/cache/seal.py",
      "    def __exit__(self, *exc: object) -> None:\n        self.stop()",
      "    def __exit__(self, *exc: object) -> None:\n        pass",
      ["tests/test_cache_seal.py"]),
    # -- cache/alongside.py: converting while hashing ---------------------------------------------------------------
    m("alongside-published-under-provisional-name", "transformd/cache/store.py",
      "                key = hasher.key\n                timings[\"hash_alongside\"]",
      "                timings[\"hash_alongside\"]", ALONGSIDE_TESTS),
    m("alongside-key-lock-not-taken", "transformd/cache/alongside.py",
      "            if lock.try_acquire(owner=process_identity()):\n                self.key_lock = lock",
      "            if False:\n                self.key_lock = lock", ALONGSIDE_TESTS),
    m("alongside-key-locked-after-the-stat-cache", "transformd/cache/alongside.py",
      "cancelled=self._stop.is_set, before_saving=lock_key, pace=self._pace)\n",
      "cancelled=self._stop.is_set, pace=self._pace)\n            lock_key(ident)\n", ALONGSIDE_TESTS),
    m("alongside-copy-not-recognised", "transformd/cache/alongside.py",
      "                if self.key_lock is None or entry.exists():", "                if self.key_lock is None:",
      ALONGSIDE_TESTS),
    m("alongside-racy-files-not-excluded", "transformd/cache/alongside.py",
      " < self.hash_alongside_min_bytes or not settled(tree):", " < self.hash_alongside_min_bytes:",
      ALONGSIDE_TESTS),
    m("alongside-waiter-not-told-of-failure", "transformd/cache/store.py",
      "                for name in {key, hasher.key if hasher is not None else None} - {None}:",
      "                for name in {key}:", ALONGSIDE_TESTS),
    # -- the daemon's first resolve, converting while hashing ----------------------------------------------------------
    m("daemon-alongside-caller-not-checked", "transformd/daemon/app.py",
      "        missing = reader.denied(pending.access)\n", "        missing = None\n", DAEMON_ALONGSIDE_TESTS,
      expected_survivor=True, note="a second layer since issue 42: the tree is checked for the caller as it is opened "
      "(securefs.open_source asks the reader, with the caller's credentials or by mode bits), before this"),
    m("daemon-alongside-waits-for-the-queue", "transformd/daemon/service.py",
      "            if provisional and self.queued_count() >= free_workers:", "            if False:",
      DAEMON_ALONGSIDE_TESTS),
    m("daemon-stopping-not-told", "transformd/daemon/server.py",
      "        if self._on_stopping is not None:\n            self._on_stopping()\n", "", DAEMON_ALONGSIDE_TESTS),
    m("daemon-alongside-never-taken", "transformd/daemon/app.py",
      "            ident = await service.identify(source, defer=True, reader=reader)\n",
      "            ident = await service.identify(source, reader=reader)\n",
      DAEMON_ALONGSIDE_TESTS),
    # -- issue 42, second trust round: select, caps, client, listener, the two planted bugs ----------------------------
    m("select-refusal-ignored", "transformd/daemon/state.py", "            raise error_for_exception(e) from None",
      "            return", HOLD_TESTS),
    m("caller-queue-not-reserved", "transformd/daemon/service.py", "        keys[key] = keys.get(key, 0) + 1", "        pass",
      CAP_TESTS),
    m("lease-count-not-serialised", "transformd/daemon/state.py",
      "        turn = self._lease_turns.get(caller.uid)\n",
      "        return contextlib.nullcontext()\n        turn = self._lease_turns.get(caller.uid)\n", CAP_TESTS),
    m("client-socket-owner-unchecked", "transformd/client.py",
      "    if st.st_uid in (os.geteuid(), 0) or not parent.st_mode & 0o022:", "    if True:", CLIENT_TRUST_TESTS),
    m("client-deep-json-escapes", "transformd/client.py", "    except RecursionError as err:\n        raise ValueError(",
      "    except ZeroDivisionError as err:\n        raise ValueError(", CLIENT_TRUST_TESTS),
    m("client-shape-overflow-unchecked", "transformd/answers.py", "        if math.prod(d for d in shape if d) >= ",
      "        if False and math.prod(d for d in shape if d) >= ", CLIENT_TRUST_TESTS),
    m("listener-no-admin-room", "transformd/daemon/peers.py", "limit -= admin_room(limit)", "limit -= 0",
      LISTENER_TESTS),
    m("write-deadline-never-cuts", "transformd/daemon/peers.py",
      "                self.transport.abort()\n                return\n", "                pass\n", LISTENER_TESTS),
    m("token-owner-unchecked", "transformd/daemon/settings.py", "    if st.st_uid != os.geteuid():", "    if False:",
      LISTENER_TESTS),
    m("group-bits-for-outsiders", "transformd/daemon/peers.py",
      "        return (mode >> 3) & 7\n    return mode & 7", "        return (mode >> 3) & 7\n    return (mode >> 3) & 7",
      PLANTED_TESTS),
    m("download-record-followed", "transformd/cache/securefs.py",
      "fd = os.open(parts[-1], OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=cur)", "fd = os.open(parts[-1], OPEN_FLAGS, dir_fd=cur)",
      PLANTED_TESTS),
    m("download-record-dirs-followed", "transformd/cache/securefs.py",
      "cur = os.open(p, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=cur)", "cur = os.open(p, DIR_FLAGS, dir_fd=cur)",
      PLANTED_TESTS),
    # -- the remote tier: what is fetched from a bucket is checked before it is kept -------------------------------
    m("remote-digest-unchecked", "transformd/remote/fetch.py", "        if digest != rec.digest:",
      "        if False:", REMOTE_TESTS),
    m("remote-size-unchecked", "transformd/remote/fetch.py", "        if size != rec.size:", "        if False:",
      REMOTE_TESTS),
    m("remote-names-unchecked", "transformd/remote/names.py", "        why = _name_problem(name)\n",
      "        why = None\n", REMOTE_TESTS),
    m("remote-manifest-before-files", "transformd/remote/publish.py", "    largest_first = sorted(",
      "    store.write_bytes(names.manifest_name(key), raw, create=True)\n    largest_first = sorted(", REMOTE_TESTS),
    m("remote-failure-keeps-files", "transformd/remote/fetch.py", "    except BaseException:\n        rmtree_force(out)",
      "    except BaseException:\n        pass", REMOTE_TESTS),
    m("remote-ranged-hash-own-part", "transformd/remote/fetch.py",
      "                    part = mine if mine is not None and at == start else os.pread(self.fd, n, at)\n",
      "                    part = mine if mine is not None else os.pread(self.fd, n, at)\n",
      ["tests/test_remote.py", "-k", "file_order or damaged_part"]),
    m("remote-repo-id-hashed-first", "transformd/request.py",
      "    return alias is None or tier.alias_key(*alias, recipe) is not None\n", "    return True\n",
      ["tests/test_remote_wiring.py", "-k", "new_to_the_tier or records_its_alias"]),
    m("status-wait-ignored", "transformd/daemon/app.py", "            await job.wait_ended(wait)\n",
      "            pass\n", ["tests/test_api_checkpoints.py", "-k", "waits_answers"]),
    # -- engines: no silent default path (issue 44) ----------------------------------------------------------------------
    m("no-engine-named-misload-served", "transformd/engines.py", "    silent = misloaded_by(report)\n",
      "    silent = {}\n", ["tests/test_expert_split.py", "-k", "no_engine or renaming"]),
    m("split-stack-header-unsplit", "transformd/checkpoint/plan.py", "        split = shard.splits.get(t.name)\n",
      "        split = None\n", ["tests/test_expert_split.py", "-k", "reference_per_expert"]),
]


def _copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for name in ("transformd", "tests"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")


def _simulated_gpu_record(copy: Path) -> None:
    record = copy / "tests" / "gpu" / "last_run.json"
    if record.exists():
        return
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import run_gpu_suite as suite

    files = suite.source_digests(copy)
    record.write_text(json.dumps({
        "schema": 1, "dry_run": False, "device": "simulated by the mutation pass (no GPU)", "device_count": 0,
        "capability": None, "variants_run": ["portable", "ptx"], "variants_not_run": [], "passed": 1, "failed": 0,
        "failures": [], "kernel_sources": {"digest": suite.combined_digest(files), "files": files},
        "git_commit": None, "versions": {}, "finished_at": None,
    }, indent=1))


def planted(root: Path, mutant: Mutant) -> dict[Path, str]:
    """The files of the checkout ``root`` that ``mutant`` changes, with their text once it is planted."""
    files = sorted((root / "transformd").rglob("*.py")) if mutant.file == "*" else [root / mutant.file]
    changed = {}
    for f in files:
        text = f.read_text()
        if mutant.old not in text:
            continue
        changed[f] = (text.replace(mutant.old, mutant.new) if mutant.count == -1
                      else text.replace(mutant.old, mutant.new, 1))
    if not changed:
        raise SystemExit(f"mutant {mutant.id}: {mutant.old!r} not found in {mutant.file}; update the mutant")
    return changed


def _apply(copy: Path, mutant: Mutant) -> list[Path]:
    changed = planted(copy, mutant)
    for f, text in changed.items():
        f.write_text(text)
    return list(changed)


def _pytest(copy: Path, args: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - started, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, time.monotonic() - started, lines[-1] if lines else done.stderr[-300:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only these mutant ids")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test selection unmutated first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    mutants = [x for x in MUTANTS if not args.only or x.id in args.only]
    if args.list:
        for x in mutants:
            print(f"{x.id:40} {x.file}")
        return 0
    if args.only and len(mutants) != len(set(args.only)):
        raise SystemExit(f"unknown ids: {sorted(set(args.only) - {x.id for x in MUTANTS})}")
    work = Path(tempfile.mkdtemp(prefix="td-mutants-"))
    results = []
    try:
        pristine, copy = work / "pristine", work / "copy"
        _copy_tree(pristine)
        _simulated_gpu_record(pristine)
        if not args.no_baseline:
            for sel in dict.fromkeys(x.tests for x in mutants):
                rc, secs, last = _pytest(pristine, sel, args.timeout)
                print(f"baseline {' '.join(sel)[:70]}: rc {rc} in {secs:.0f} s: {last}", flush=True)
                if rc != 0:
                    raise SystemExit("the unmutated copy fails these tests: fix that before judging mutants")
        for x in mutants:
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(pristine, copy)
            _apply(copy, x)
            rc, secs, last = _pytest(copy, x.tests, args.timeout)
            verdict = "survived" if rc == 0 else "killed" if rc == 1 else f"killed (rc {rc})"
            results.append({"id": x.id, "file": x.file, "verdict": verdict, "seconds": round(secs, 1),
                            "tests": " ".join(x.tests), "expected_survivor": x.expected_survivor, "note": x.note,
                            "last_line": last})
            print(f"{x.id:40} {verdict:18} {secs:6.1f} s  {last}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| mutant | file | result | note |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['id']} | {r['file']} | {r['verdict']} | {r['note']} |")
    killed = sum(r["verdict"] != "survived" for r in results)
    print(f"\n{killed} of {len(results)} killed")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    unexpected = [r["id"] for r in results if r["verdict"] == "survived" and not r["expected_survivor"]]
    if unexpected:
        print(f"unexpected survivors: {', '.join(unexpected)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
