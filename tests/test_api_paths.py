"""Unit tests of the daemon's source policy (transformd/daemon/paths.py): which paths resolve inside the allowed roots.

Each case is a path an attacker could send, and the one answer the policy must give. The layout under ``tmp``::

    models/          the allowed root
      good/          a source (config.json, shard), sub/ holds one more file
      inner-link ->  models/good (a symlink that stays inside: allowed)
      out-link   ->  outside/secret-model (a symlink that leaves: refused)
      evil-link  ->  models-evil/ckpt (a sibling whose name starts with "models": refused)
      leaky/       a source whose shard links outside, leaky-sub/ one whose sub-directory does
    models-evil/ckpt/  a sibling of the root sharing its name as a string prefix
    outside/secret-model/

A string-prefix check (``real.startswith(root)``), a check of the unresolved path, or a tree scan that does not
resolve symlinks each fail at least one of these.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from transformd.daemon.errors import ApiError
from transformd.daemon.paths import SourcePolicy


def _source(d: Path) -> Path:
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    (d / "sub" / "extra.json").write_text("{}")
    return d


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    models, evil, outside = tmp_path / "models", tmp_path / "models-evil", tmp_path / "outside"
    good = _source(models / "good")
    _source(evil / "ckpt")
    _source(outside / "secret-model")
    (models / "inner-link").symlink_to(good)
    (models / "out-link").symlink_to(outside / "secret-model")
    (models / "evil-link").symlink_to(evil / "ckpt")
    leaky = _source(models / "leaky")
    (leaky / "model.safetensors").unlink()
    (leaky / "model.safetensors").symlink_to(outside / "secret-model" / "model.safetensors")
    leaky_sub = _source(models / "leaky-sub")
    (leaky_sub / "sub" / "extra.json").unlink()
    (leaky_sub / "sub").rmdir()
    (leaky_sub / "sub").symlink_to(outside / "secret-model" / "sub")
    prefix_leak = _source(models / "prefix-leak")  # a file symlinked into the sibling with the root's name as prefix
    (prefix_leak / "config.json").unlink()
    (prefix_leak / "config.json").symlink_to(evil / "ckpt" / "config.json")
    return {"tmp": tmp_path, "models": models, "evil": evil, "outside": outside, "good": good}


def _refused(policy: SourcePolicy, source: str | Path) -> ApiError:
    with pytest.raises(ApiError) as info:
        policy.resolve(str(source))
    return info.value


def test_allowed_is_a_path_containment_test_not_a_string_prefix(tree) -> None:
    models = str(tree["models"])
    for spelled in (models, models + "/"):  # a trailing slash on the root changes nothing
        policy = SourcePolicy([spelled])
        assert policy.allowed(models)
        assert policy.allowed(models + "/good")
        assert policy.allowed(models + "/good/sub/extra.json")
        assert not policy.allowed(models + "-evil")
        assert not policy.allowed(models + "-evil/ckpt")
        assert not policy.allowed(models + "evil")
        assert not policy.allowed(str(tree["tmp"]))
        assert not policy.allowed("/")


def test_sources_inside_the_root_resolve_to_their_real_path(tree) -> None:
    policy = SourcePolicy([tree["models"]])
    good = tree["good"].resolve()
    assert policy.resolve(str(tree["good"])) == good
    assert policy.resolve(str(tree["models"] / "inner-link")) == good  # a symlink that stays inside
    assert policy.resolve(str(tree["models"] / "leaky" / ".." / "good")) == good  # '..' that stays inside
    assert policy.resolve(f"/proc/self/root{tree['good']}") == good  # /proc/self/root is "/" here


@pytest.mark.parametrize(
    "spell",
    [
        pytest.param(lambda t: t["evil"] / "ckpt", id="sibling directory sharing the root's name as prefix"),
        pytest.param(lambda t: t["evil"], id="the sibling itself"),
        pytest.param(lambda t: t["models"] / ".." / "outside" / "secret-model", id="'..' out of the root"),
        pytest.param(lambda t: t["models"] / "good" / ".." / ".." / "models-evil" / "ckpt", id="'..' into the sibling"),
        pytest.param(lambda t: t["models"] / "out-link", id="symlink inside the root to outside"),
        pytest.param(lambda t: t["models"] / "evil-link", id="symlink inside the root to the sibling"),
        pytest.param(lambda t: f"/proc/self/root{t['outside']}/secret-model", id="/proc/self/root to outside"),
        pytest.param(lambda t: t["outside"] / "missing", id="missing path outside (no probing: 403, not 404)"),
    ],
)
def test_sources_outside_the_root_are_403_source_not_allowed(tree, spell) -> None:
    err = _refused(SourcePolicy([tree["models"]]), spell(tree))
    assert (err.status, err.code) == (403, "source_not_allowed"), err.message
    assert "outside the allowed roots" in err.message


def test_proc_self_cwd_and_fd_links_resolve_to_what_they_point_at(tree, monkeypatch) -> None:
    policy = SourcePolicy([tree["models"]])
    monkeypatch.chdir(tree["outside"])
    assert _refused(policy, "/proc/self/cwd/secret-model").code == "source_not_allowed"
    fd = os.open(tree["evil"] / "ckpt", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _refused(policy, f"/proc/self/fd/{fd}").code == "source_not_allowed"
    finally:
        os.close(fd)
    monkeypatch.chdir(tree["models"])
    assert policy.resolve("/proc/self/cwd/good") == tree["good"].resolve()


@pytest.mark.parametrize("name", ["leaky", "leaky-sub", "prefix-leak"])
def test_a_symlink_inside_the_source_that_leaves_the_root_is_403(tree, name) -> None:
    """The source directory is inside; one of its files or sub-directories links out (to outside/ or the sibling)."""
    err = _refused(SourcePolicy([tree["models"]]), tree["models"] / name)
    assert (err.status, err.code) == (403, "source_not_allowed"), err.message
    assert "symlink" in err.message


def test_a_symlinked_root_is_resolved_once(tree) -> None:
    alias = tree["tmp"] / "alias"
    alias.symlink_to(tree["models"])
    policy = SourcePolicy([alias])
    assert policy.resolve(str(tree["good"])) == tree["good"].resolve()
    assert _refused(policy, tree["evil"] / "ckpt").code == "source_not_allowed"


def test_several_roots(tree) -> None:
    policy = SourcePolicy([tree["models"], tree["outside"]])
    assert policy.resolve(str(tree["outside"] / "secret-model")) == (tree["outside"] / "secret-model").resolve()
    assert policy.resolve(str(tree["models"] / "leaky")) == (tree["models"] / "leaky").resolve()
    assert _refused(policy, tree["evil"] / "ckpt").code == "source_not_allowed"


def test_no_roots_refuse_everything(tree) -> None:
    err = _refused(SourcePolicy([]), tree["good"])
    assert (err.status, err.code) == (403, "source_not_allowed") and "--allow-root" in err.message


@pytest.mark.parametrize(
    "source, status, code",
    [
        ("", 400, "bad_source"),
        ("relative/path", 400, "bad_source"),
        ("/models\0/x", 400, "bad_source"),
        ("/" + "a" * 5000, 400, "bad_source"),
    ],
)
def test_malformed_sources_are_400_before_any_file_system_access(tree, source, status, code) -> None:
    err = _refused(SourcePolicy([tree["models"]]), source)
    assert (err.status, err.code) == (status, code)


def test_missing_or_non_directory_sources_inside_the_root(tree) -> None:
    policy = SourcePolicy([tree["models"]])
    assert (_refused(policy, tree["models"] / "nope").status, _refused(policy, tree["models"] / "nope").code) == (
        404,
        "source_not_found",
    )
    err = _refused(policy, tree["good"] / "config.json")
    assert (err.status, err.code) == (400, "bad_source")
