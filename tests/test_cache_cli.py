"""``transformd cache ls | verify [KEY] | gc | rm KEY`` through add_commands."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from transformd.cache import Cache
from transformd.cli import main
from transformd.cli.cache import add_commands

from .support.fakes import CopyConverter, write_source


@pytest.fixture
def filled(tmp_path):
    cache = Cache(tmp_path / "cache", budget_bytes="10M", converter=CopyConverter())
    srcs = [write_source(tmp_path / f"model{i}", seed=i) for i in range(3)]
    entries = [cache.get_or_convert(s) for s in srcs]
    for i, e in enumerate(entries):  # model0 used longest ago
        t = time.time() - 1000 * (3 - i)
        os.utime(e.root, (t, t))
    return cache, srcs, entries


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_add_commands_registers_on_an_outer_parser(tmp_path):
    parser = argparse.ArgumentParser(prog="transformd")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    args = parser.parse_args(["cache", "verify", "0" * 32, "--cache-dir", str(tmp_path)])
    assert args.command == "cache" and args.cache_command == "verify" and args.key == "0" * 32
    assert args.cache_dir == str(tmp_path) and callable(args.handler)
    with pytest.raises(SystemExit):
        parser.parse_args(["cache"])


def test_ls(capsys, filled, monkeypatch):
    cache, srcs, entries = filled
    monkeypatch.setenv("TRANSFORMD_CACHE_BUDGET", "10M")
    with cache.lease(entries[2].key):
        code, out, _ = run(capsys, "cache", "ls", "--cache-dir", str(cache.root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"cache {cache.root}"
    assert lines[1].split() == ["KEY", "SIZE", "LAST", "USED", "RECIPE", "LEASES", "SOURCE"]
    rows = lines[2:5]
    assert [r.split()[0] for r in rows] == [entries[2].key, entries[1].key, entries[0].key]  # most recent first
    for row, src in zip(rows, reversed(srcs), strict=True):
        assert row.rstrip().endswith(str(src)) and "fnuz/exact" in row and "KiB" in row
    assert rows[0].split()[-2] == "1" and rows[1].split()[-2] == "0"  # live leases
    assert "3 entries" in lines[5] and "of 9.5 MiB budget" in lines[5]
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", str(cache.root), "--json")
    data = json.loads(out)
    assert [e["key"] for e in data["entries"]] == [e.key for e in reversed(entries)]
    assert data["entries"][0]["size_bytes"] == entries[2].size_bytes and data["budget_bytes"] == 10_000_000


def test_ls_empty_cache_from_the_environment(capsys, tmp_path, monkeypatch):
    Cache(tmp_path / "envcache")  # created by a command that writes (convert, serve)
    monkeypatch.setenv("TRANSFORMD_CACHE_DIR", str(tmp_path / "envcache"))
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0 and f"cache {tmp_path / 'envcache'}" in out and "no entries" in out


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["verify"], ["gc"], ["rm", "0" * 32]])
def test_a_mistyped_cache_dir_is_refused_not_created(capsys, tmp_path, monkeypatch, command):
    """A cache directory that does not exist, or that is not a transformd cache, is exit 2 with one line that
    names it; nothing is created there (only commands that convert create a cache)."""
    missing = tmp_path / "cahce"
    code, out, err = run(capsys, "cache", *command, "--cache-dir", str(missing))
    assert (code, out) == (2, "") and not missing.exists()
    assert err.startswith(f"transformd: error: no transformd cache at {missing} (--cache-dir)")
    assert len(err.splitlines()) == 1
    monkeypatch.setenv("TRANSFORMD_CACHE_DIR", str(missing))
    code, out, err = run(capsys, "cache", *command)
    assert code == 2 and "$TRANSFORMD_CACHE_DIR" in err and not missing.exists()
    monkeypatch.delenv("TRANSFORMD_CACHE_DIR")
    home = tmp_path / "home"  # an existing directory that is not a cache: left untouched
    home.mkdir()
    (home / "notes.txt").write_text("x")
    code, out, err = run(capsys, "cache", *command, "--cache-dir", str(home))
    assert code == 2 and f"{home} (--cache-dir) is not a transformd cache" in err, err
    assert sorted(os.listdir(home)) == ["notes.txt"]
    code, out, err = run(capsys, "cache", *command, "--cache-dir", str(home / "notes.txt"))
    assert code == 2 and "is not a directory" in err


def test_a_mistyped_cache_dir_through_the_transformd_command(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "transformd", "cache", "ls", "--cache-dir", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert p.returncode == 2 and "no transformd cache at" in p.stderr and not (tmp_path / "nope").exists()


def test_verify(capsys, filled):
    cache, _, entries = filled
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", str(cache.root))
    assert code == 0 and out.count("ok ") == 3 and "3 entries checked, 0 corrupt" in out
    f = entries[1].path / "model-00002-of-00002.safetensors"
    os.chmod(f.parent, 0o755)
    os.chmod(f, 0o644)
    with open(f, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))
    code, out, _ = run(capsys, "cache", "verify", entries[1].key, "--cache-dir", str(cache.root))
    assert code == 1
    assert f"CORRUPT  {entries[1].key} -> quarantined to {cache.quarantine_dir}" in out
    assert "model-00002-of-00002.safetensors: content digest" in out
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", str(cache.root))
    assert code == 0 and "2 entries checked, 0 corrupt" in out


def test_gc_and_rm(capsys, filled):
    cache, _, entries = filled
    size = entries[0].size_bytes
    code, out, _ = run(capsys, "cache", "gc", "--cache-dir", str(cache.root), "--budget", str(2 * size + 10))
    assert code == 0 and f"evicted  {entries[0].key}" in out and "evicted 1 entries" in out
    assert cache.get(entries[0].key) is None and cache.get(entries[1].key) is not None
    code, out, err = run(capsys, "cache", "rm", entries[1].key, "--cache-dir", str(cache.root))
    assert code == 0 and out.startswith(f"removed  {entries[1].key}")
    with cache.lease(entries[2].key):
        code, out, err = run(capsys, "cache", "rm", entries[2].key, "--cache-dir", str(cache.root))
        assert code == 1 and "leased" in err and cache.get(entries[2].key) is not None
        code, out, err = run(capsys, "cache", "rm", entries[2].key, "--force", "--cache-dir", str(cache.root))
        assert code == 0
    assert cache.entries() == []
    code, out, err = run(capsys, "cache", "rm", "../../etc", "--cache-dir", str(cache.root))
    assert code == 2 and err.startswith("transformd: error: not a cache key")
    code, out, err = run(capsys, "cache", "rm", "0" * 32, "--cache-dir", str(cache.root))
    assert code == 1 and "no cache entry" in err
    code, out, err = run(capsys, "cache", "gc", "--budget", "lots", "--cache-dir", str(cache.root))
    assert code == 2 and "cannot parse size" in err
    for size in ("1e999", "1e999G"):  # (1e999 was an OverflowError's traceback: an attack review)
        code, out, err = run(capsys, "cache", "gc", "--budget", size, "--cache-dir", str(cache.root))
        assert code == 2 and err.strip() == f"transformd: error: size must be a finite number of bytes, not " \
                                            f"negative: {size}", err


def test_module_entry_point(tmp_path, filled):
    cache, _, entries = filled
    p = subprocess.run(
        [sys.executable, "-m", "transformd", "cache", "ls", "--cache-dir", str(cache.root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert all(e.key in p.stdout for e in entries)


def test_plugs_into_the_transformd_parser(capsys, filled):
    from transformd.cli import build_parser

    cache, _, entries = filled
    args = build_parser().parse_args(["cache", "ls", "--cache-dir", str(cache.root)])  # wired by default
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert all(e.key in out for e in entries)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give entries/ another owner")
def test_a_user_who_may_not_list_the_cache_is_told_so_in_one_line(capsys, filled, monkeypatch):
    """The cache's entries/ is 0711: another user's `cache ls` was a PermissionError naming entries/; it says whose
    the cache is and what to do (as uid 65534 the same: checked by hand with a setuid child)."""
    cache, _, _ = filled
    os.chown(cache.entries_dir, 4242, -1)  # (its owner's own refusals, a read-only disk, the cache reports itself)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    for command, verb in (("ls", "list"), ("verify", "list"), ("gc", "change")):
        code, out, err = run(capsys, "cache", command, "--cache-dir", str(cache.root))
        assert code == 1 and out == "" and err == (
            f"transformd: error: this user may not {verb} the cache {cache.root} (uid 4242's): run "
            f"'transformd cache {command}' as that user, or as root\n"), err
