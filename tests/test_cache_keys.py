"""Cache keys: content identity, stat cache, hub-cache layout, recipe, key validation."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from transformd.cache import Cache, InvalidKeyError, Recipe, SourceError, cache_key, source_identity, validate_key
from transformd.cache import keys as keys_mod
from transformd.cache.keys import StatCache
from transformd.formats import FORMAT_VERSION

from .support.fakes import CopyConverter, write_source


@pytest.fixture
def count_hashes(monkeypatch):
    """Count the files the key code actually reads (every read goes through keys.hash_file)."""
    calls: list[str] = []
    real = keys_mod.hash_file

    def counting(path, *args, **kwargs):
        p = os.fspath(path)
        # the key code reads through checked descriptors (cache.securefs): name the file the descriptor is
        calls.append(os.readlink(p) if p.startswith("/proc/self/fd/") else p)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(keys_mod, "hash_file", counting)
    return calls


def test_same_content_at_two_paths_gives_one_entry(tmp_path):
    a = write_source(tmp_path / "a" / "model")
    b = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, b)
    log = tmp_path / "conversions.log"
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter(log))
    ea = cache.get_or_convert(a)
    eb = cache.get_or_convert(b)
    assert ea.key == eb.key
    assert ea.path == eb.path
    assert (ea.outcome, eb.outcome) == ("converted", "hit")
    assert log.read_text().count("\n") == 1
    assert [e.key for e in cache.entries()] == [ea.key]
    # the manifest keeps the first path as a hint only
    assert ea.manifest.source_hint == str(a)


def test_the_key_names_who_could_rewrite_the_source(tmp_path):
    """Copies share a key only when the same people could change their bytes in place: the owners, and the groups
    or everyone where the mode lets them write (keys.source_writers). The content ids stand for bytes read before
    the conversion reads them again; a writer can change them in between without moving a timestamp (through a
    memory map: test_trust_claims), and his entry must never be served for another's copy."""
    a = write_source(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)

    def key(src: Path) -> str:
        return cache_key(source_identity(src), Recipe())

    def chmod(src: Path, mode: int) -> None:
        for f in src.iterdir():
            os.chmod(f, mode)

    assert key(a) == key(b) and source_identity(a).writers == (f"uid:{os.geteuid()}",)
    chmod(b, 0o444)
    assert key(a) == key(b), "the owner may always make his file writable"
    chmod(b, 0o664)
    assert key(a) != key(b) and f"gid:{os.getegid()}" in source_identity(b).writers
    chmod(b, 0o646)
    assert key(a) != key(b) and "other" in source_identity(b).writers
    chmod(b, 0o644)
    assert key(a) == key(b)
    if os.geteuid() == 0:
        for f in b.iterdir():
            os.chown(f, 65534, 65534)
        assert key(a) != key(b) and source_identity(b).writers == ("uid:65534",)
        for f in b.iterdir():
            os.chown(f, os.geteuid(), os.getegid())
    assert key(a) == key(b)
    # a POSIX ACL's named writers show in the mode only as the group's (its mask): the ACL itself is named
    for src, named in ((a, 1234), (b, 4321)):
        for f in src.iterdir():
            try:
                os.setxattr(f, "system.posix_acl_access", _acl(user_rw=named))
            except OSError as e:
                pytest.skip(f"no POSIX ACLs here: {e}")
    assert source_identity(a).writers[0].startswith("acl:") and key(a) != key(b)



#: Run in a new user namespace, whose maps the parent writes once it reads the first line: each source's key and
#: writers as a process there computes them.
_IN_A_USER_NAMESPACE = """
import ctypes, json, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000):  # CLONE_NEWUSER
    print(json.dumps({"errno": ctypes.get_errno()}), flush=True)
    sys.exit()
print("{}", flush=True)
sys.stdin.readline()
from transformd.cache import Recipe, cache_key, source_identity
ids = {src: source_identity(src) for src in sys.argv[1:]}
print(json.dumps({src: [cache_key(i, Recipe()), list(i.writers)] for src, i in ids.items()}), flush=True)
"""


def test_a_user_namespace_names_the_writers_as_the_host_does():
    """In a user namespace (a rootless container) uid 1000 outside is 0 inside, and every owner the namespace does
    not map shows as the same overflow id (65534). A process there keys a source as the host does, so a
    ``convert --cache-dir`` in a container finds the entry the host's daemon made of the same files (before, it
    converted them again); and two copies whose different owners both show as 65534 there do not share a key
    (before, they did: either owner's entry was served for the other's copy)."""
    root = os.geteuid() == 0
    uid, gid = (1000, 1000) if root else (os.geteuid(), os.getegid())
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own directories are 0700: the namespace's uid could not enter
    try:
        os.chmod(top, 0o755)
        mine = write_source(top / "mine")
        srcs = [mine]
        if root:  # owners the namespace does not map: root, and another user
            srcs += [Path(shutil.copytree(mine, top / name)) for name in ("roots", "theirs")]
            for src, owner in ((mine, uid), (srcs[2], 2000)):
                for f in [src, *src.rglob("*")]:
                    os.chown(f, owner, owner)
        child = subprocess.Popen([sys.executable, "-c", _IN_A_USER_NAMESPACE, *map(str, srcs)], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=Path(__file__).parents[1])
        try:
            if "errno" in json.loads(child.stdout.readline()):
                pytest.skip("no user namespaces here")
            try:
                Path(f"/proc/{child.pid}/setgroups").write_text("deny")
                # as root, the overflow id is mapped too (as rootless podman maps 0-65535): unmapped owners still
                # show as 65534, which now names some other owner outside
                more = "1 200001 65535\n" if root else ""
                Path(f"/proc/{child.pid}/uid_map").write_text(f"0 {uid} 1\n{more}")
                Path(f"/proc/{child.pid}/gid_map").write_text(f"0 {gid} 1\n{more}")
            except OSError as e:
                pytest.skip(f"cannot map ids into a user namespace here: {e}")
            inside = json.loads(child.communicate("go\n", timeout=120)[0])
        finally:
            child.kill()
            child.wait()
        here = {str(src): source_identity(src) for src in srcs}
        assert here[str(mine)].writers == (f"uid:{uid}",)
        assert inside[str(mine)] == [cache_key(here[str(mine)], Recipe()), [f"uid:{uid}"]]
        if root:
            roots, theirs = inside[str(srcs[1])], inside[str(srcs[2])]
            assert roots[0] != theirs[0], (roots, theirs)
            assert all(w.startswith("file:") for w in roots[1] + theirs[1]), (roots, theirs)
    finally:
        shutil.rmtree(top)



def test_an_acl_seen_in_a_user_namespace_names_its_users_as_the_host_does(monkeypatch):
    """The kernel shows an ACL's user and group ids in the reader's namespace: they are translated like owners, and
    an ACL naming an id the map does not cover cannot be told from another's (it names the file instead)."""
    from transformd.cache import writers

    maps = {"uid": ((0, 1000, 1), (1, 200001, 10)), "gid": ((0, 1000, 1),)}
    monkeypatch.setattr(writers, "_id_map", maps.get)
    assert writers._acl_outside(_acl(user_rw=0)) == _acl(user_rw=1000)
    assert writers._acl_outside(_acl(user_rw=3)) == _acl(user_rw=200003)
    assert writers._acl_outside(_acl(user_rw=11)) is None  # outside the map
    assert writers._acl_outside(_acl(user_rw=65534)) is None  # the overflow id: any unmapped user
    assert writers._acl_outside(_acl(user_rw=1)[:-1]) is None  # not an ACL
    monkeypatch.setattr(writers, "_id_map", lambda kind: None)  # the initial namespace: the bytes as they are
    assert writers._acl_outside(_acl(user_rw=11)) == _acl(user_rw=11)


def _acl(user_rw: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form): owner rw, user ``user_rw`` rw, group r, mask rw, other r."""
    import struct

    none = 0xFFFFFFFF
    entries = [(0x01, 6, none), (0x02, 6, user_rw), (0x04, 4, none), (0x10, 6, none), (0x20, 4, none)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


#: A source with every kind of file a checkpoint has: shards, the index, configs, tokenizer files, others.
EVERY_KIND_OF_FILE = {
    "config.json": b'{"model_type": "fake", "hidden_size": 128}',
    "generation_config.json": b'{"do_sample": true}',
    "hf_quant_config.json": b'{"quantization": {"quant_algo": "MXFP8"}}',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 64,
    "model-00002-of-00002.safetensors": bytes(range(255, -1, -1)) * 64,
    "model.safetensors.index.json": b'{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}',
    "special_tokens_map.json": b'{"eos_token": "</s>"}',
    "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {"a": 0}}}',
    "tokenizer_config.json": b'{"model_max_length": 4096}',
    "README.md": b"# a model card\n",
    "sub/extra.json": b'{"a": 1}',
}


def test_the_identity_lists_every_file_of_the_source(tmp_path):
    """The case list below covers what the key reads: a file it skipped would make its case vacuous."""
    src = write_source(tmp_path / "m", EVERY_KIND_OF_FILE)
    assert [f.name for f in source_identity(src).files] == sorted(EVERY_KIND_OF_FILE)


@pytest.mark.parametrize("victim", sorted(EVERY_KIND_OF_FILE))
def test_one_changed_byte_in_any_file_gives_a_new_key(tmp_path, victim):
    src = write_source(tmp_path / "m", EVERY_KIND_OF_FILE)
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    key1 = cache.key_for(src)
    f = src / victim
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the content differs
    key2 = cache.key_for(src)
    assert key2 != key1
    assert cache_key(source_identity(src), Recipe()) == key2  # without the stat cache too
    data[len(data) // 2] ^= 0x01  # restore: the old key comes back
    f.write_bytes(bytes(data))
    assert cache.key_for(src) == key1


def test_added_or_removed_file_changes_the_key(tmp_path):
    src = write_source(tmp_path / "m")
    k0 = cache_key(source_identity(src), Recipe())
    write_source(src, {"generation_config.json": b"{}"})
    k1 = cache_key(source_identity(src), Recipe())
    (src / "generation_config.json").unlink()
    (src / "tokenizer.json").rename(src / "tokenizer2.json")  # same bytes, another name
    k2 = cache_key(source_identity(src), Recipe())
    assert len({k0, k1, k2}) == 3


def test_hidden_files_are_not_part_of_the_identity(tmp_path):
    src = write_source(tmp_path / "m")
    k0 = cache_key(source_identity(src), Recipe())
    write_source(src, {".cache/huggingface/download/x.metadata": b"etag", ".gitattributes": b"*"})
    assert cache_key(source_identity(src), Recipe()) == k0


def test_recipe_is_part_of_the_key(tmp_path):
    ident = source_identity(write_source(tmp_path / "m"))
    keys = {
        cache_key(ident, Recipe()),
        cache_key(ident, Recipe(target="ocp")),
        cache_key(ident, Recipe(scale_mode="amax")),
        cache_key(ident, Recipe(select="model.layers.0.*")),
        cache_key(ident, Recipe(format_version=FORMAT_VERSION + 1)),
    }
    assert len(keys) == 5
    assert cache_key(ident, Recipe("fnuz", "exact", None)) == cache_key(ident, Recipe())
    assert Recipe(select="") == Recipe()
    with pytest.raises(ValueError):
        Recipe(target="bf16")
    with pytest.raises(ValueError):
        Recipe(scale_mode="nearest")


def test_stat_cache_avoids_rehashing(tmp_path, count_hashes):
    src = write_source(tmp_path / "m")
    n = len(list(keys_mod.iter_source_files(src)))
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    first = cache.identity(src)
    assert first.hashed_files == n and len(count_hashes) == n
    count_hashes.clear()
    # a new Cache object (another process, after a restart) reads the persisted stat cache
    second = Cache(tmp_path / "cache", budget_bytes="1G").identity(src)
    assert second == first
    assert second.hashed_files == 0 and second.hashed_bytes == 0
    assert count_hashes == []
    assert list((tmp_path / "cache" / "stat-cache").glob("*.json"))
    # touching one file re-hashes that file only
    f = src / "tokenizer.json"
    t = time.time() - 30
    os.utime(f, (t, t))
    third = cache.identity(src)
    assert third == first and count_hashes == [str(f)]


def test_recently_modified_files_are_not_remembered(tmp_path, count_hashes):
    """A file modified within the timestamp granularity of its last hash is hashed again next time."""
    src = write_source(tmp_path / "m", backdate_s=0)
    sc = StatCache(tmp_path / "sc")
    source_identity(src, stat_cache=sc)
    n = len(count_hashes)
    source_identity(src, stat_cache=sc)
    assert len(count_hashes) == 2 * n


def test_same_size_same_mtime_rewrite_is_detected_by_ctime(tmp_path):
    src = write_source(tmp_path / "m")
    sc = StatCache(tmp_path / "sc")
    k1 = cache_key(source_identity(src, stat_cache=sc), Recipe())
    f = src / "model-00001-of-00002.safetensors"
    st = f.stat()
    f.write_bytes(b"\xff" * st.st_size)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    time.sleep(0.01)
    ident = source_identity(src, stat_cache=sc)
    assert ident.hashed_files == 1
    assert cache_key(ident, Recipe()) != k1


def _hub_repo(root: Path, files: dict[str, bytes], rev: str) -> Path:
    """Build a huggingface_hub cache repo: blobs named by sha256 (LFS) or git blob sha1 (small files)."""
    repo = root / "models--org--model"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / rev
    for rel, data in files.items():
        if rel.endswith(".safetensors"):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = rel.count("/") + 2
        link.symlink_to(Path(*[".."] * depth) / "blobs" / blob)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


def test_hub_cache_snapshot_uses_blob_digests_once_verified(tmp_path, count_hashes):
    """Blob names are claims: the bytes are read once (sha256 / git sha1) and the claim kept only when it matches."""
    files = {
        "model.safetensors": os.urandom(50_000),
        "config.json": b'{"model_type": "fake"}',
        "sub/tokenizer_config.json": b"{}",
    }
    snap = _hub_repo(tmp_path / "hub", files, "a" * 40)
    ident = source_identity(snap)
    # verified by hashing (not with BLAKE3: the claimed kind of digest), so no hash_file call
    assert count_hashes == [] and ident.hashed_files == 3
    by_name = {f.name: f for f in ident.files}
    assert by_name["model.safetensors"].digest == "hf-sha256:" + hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert by_name["config.json"].digest.startswith("hf-git-sha1:")
    assert len(by_name["config.json"].digest) == len("hf-git-sha1:") + 40
    assert by_name["sub/tokenizer_config.json"].digest.startswith("hf-git-sha1:")
    assert by_name["model.safetensors"].size == 50_000
    # a second revision with the same blobs is the same content
    snap2 = _hub_repo(tmp_path / "hub", files, "b" * 40)
    assert cache_key(source_identity(snap2), Recipe()) == cache_key(ident, Recipe())
    # one changed LFS blob (new sha256) gives a new key
    files2 = dict(files, **{"model.safetensors": files["model.safetensors"][:-1] + b"\0"})
    snap3 = _hub_repo(tmp_path / "hub", files2, "c" * 40)
    assert cache_key(source_identity(snap3), Recipe()) != cache_key(ident, Recipe())
    assert count_hashes == []


def test_symlinks_outside_a_hub_layout_are_hashed(tmp_path, count_hashes):
    data = tmp_path / "blobs" / ("0" * 64)  # looks like a blob, but not in a hub repo of this snapshot
    data.parent.mkdir()
    data.write_bytes(b"x" * 100)
    src = tmp_path / "plain"
    src.mkdir()
    (src / "model.safetensors").symlink_to(data)
    ident = source_identity(src)
    assert ident.files[0].digest.startswith("blake3:")
    assert count_hashes == [os.path.realpath(data)]  # read through the link's checked descriptor


def test_bad_sources_are_refused(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        source_identity(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a directory"):
        source_identity(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no files"):
        source_identity(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SourceError, match="broken symlink"):
        source_identity(tmp_path / "broken")


def test_keys_cannot_traverse(tmp_path):
    cache = Cache(tmp_path / "cache", budget_bytes="1G")
    for bad in ["../../etc", "", "ABCDEF0123456789ABCDEF0123456789", "0" * 31, "0" * 33, "0" * 31 + "/", None]:
        with pytest.raises(InvalidKeyError):
            validate_key(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            cache.get(bad)  # type: ignore[arg-type]
    assert validate_key("0123456789abcdef0123456789abcdef")


def test_warm_lookup_is_fast(tmp_path):
    files = {f"model-{i:05d}-of-00040.safetensors": os.urandom(4096) for i in range(40)}
    files["config.json"] = b"{}"
    src = write_source(tmp_path / "m", files)
    cache = Cache(tmp_path / "cache", budget_bytes="1G", converter=CopyConverter())
    entry = cache.get_or_convert(src)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        hit = cache.lookup(src)
        times.append(time.perf_counter() - t)
        assert hit is not None and hit.key == entry.key
    times.sort()
    assert times[len(times) // 2] < 0.010, f"median warm lookup {times[len(times) // 2] * 1e3:.2f} ms"


def test_hub_local_dir_download_uses_recorded_etags(tmp_path, count_hashes):
    """`hf download --local-dir` records etags in .cache/huggingface/download/<name>.metadata."""
    files = {"model.safetensors": os.urandom(20_000), "config.json": b'{"model_type": "fake"}'}
    local = write_source(tmp_path / "local", files)
    meta = local / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    etags = {
        "model.safetensors": hashlib.sha256(files["model.safetensors"]).hexdigest(),
        "config.json": hashlib.sha1(b"blob %d\0" % len(files["config.json"]) + files["config.json"]).hexdigest(),
    }
    for name, etag in etags.items():
        (meta / f"{name}.metadata").write_text(f"{'c' * 40}\n{etag}\n{time.time()}\n")
    ident = source_identity(local)
    assert count_hashes == []
    assert {f.name: f.digest for f in ident.files} == {
        "model.safetensors": "hf-sha256:" + etags["model.safetensors"],
        "config.json": "hf-git-sha1:" + etags["config.json"],
    }
    # the same revision in the hub cache layout has the same key
    snap = _hub_repo(tmp_path / "hub", files, "d" * 40)
    assert cache_key(source_identity(snap), Recipe()) == cache_key(ident, Recipe())
    # a file modified after its download record is hashed instead
    f = local / "config.json"
    f.write_bytes(b'{"model_type": "edited"}')
    later = time.time() + 10
    os.utime(f, (later, later))
    edited = {x.name: x.digest for x in source_identity(local).files}
    assert edited["config.json"].startswith("blake3:") and edited["model.safetensors"].startswith("hf-sha256:")
    assert count_hashes == [str(f)]


@pytest.mark.parametrize("layout", ["plain", "hub"])
def test_a_file_truncated_while_it_is_hashed_is_an_error_not_a_crash(tmp_path, layout):
    """The owner of a source can shorten a file while the daemon hashes it: the hashing must end in an error that
    names the file, never in a SIGBUS that kills the daemon (the fate of a memory-mapped read past the new end;
    a hub blob, verified against its name through the descriptor opened before, was read that way)."""
    files = {"model.safetensors": os.urandom(1 << 20), "config.json": b"{}"}
    src = write_source(tmp_path / "src", files) if layout == "plain" else _hub_repo(tmp_path / "hub", files, "a" * 40)
    script = (
        "import os, sys\n"
        "from transformd.cache.errors import SourceError\n"
        "from transformd.cache.keys import identity_of_tree\n"
        "from transformd.cache.securefs import open_source\n"
        "with open_source(sys.argv[1]) as tree:\n"  # sizes taken here, the file shortened before it is read
        "    os.truncate(os.path.realpath(os.path.join(sys.argv[1], 'model.safetensors')), 4096)\n"
        "    try:\n"
        "        identity_of_tree(tree)\n"
        "    except SourceError as e:\n"
        "        print('refused:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"killed ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("refused: ") and str(src / "model.safetensors") in done.stdout
    assert "it ended at byte 4096 of" in done.stdout or "changed while it was being read" in done.stdout


def test_a_paced_hashing_is_told_its_position_in_the_tree(tmp_path, monkeypatch):
    """``pace`` hears the position a read reaches in the whole tree (files the stat cache knows count, unread), the
    measure the conversion's progress uses, one slice at a time."""
    from transformd.cache.keys import identity_of_tree
    from transformd.cache.securefs import open_source

    monkeypatch.setattr(keys_mod, "HASH_CHUNK_BYTES", 4096)
    src = write_source(tmp_path / "src", {"a.safetensors": os.urandom(10_000), "b.safetensors": os.urandom(5_000)})
    sc = StatCache(tmp_path / "sc")
    source_identity(src, stat_cache=sc)  # remembers both
    data = os.urandom(5_000)
    (src / "b.safetensors").write_bytes(data)
    os.utime(src / "b.safetensors", (time.time() - 60, time.time() - 60))
    paces: list[int] = []
    with open_source(src) as tree:
        ident = identity_of_tree(tree, stat_cache=sc, pace=paces.append)
    assert paces == [10_000 + 4096, 10_000 + 5_000], "only b is read, from its place after a"
    assert ident.hashed_files == 1 and ident == source_identity(src)


def test_the_cache_maps_only_its_own_files(tmp_path, monkeypatch):
    """Entry files this user wrote are hashed through a memory map (fast); another user's (one who converted into a
    shared cache can shorten his files) are read, as sources are: a mapped file shortened meanwhile is a SIGBUS."""
    read: list[int] = []
    real = keys_mod._feed
    monkeypatch.setattr(keys_mod, "_feed", lambda h, fd, size, pace: read.append(size) or real(h, fd, size, pace))
    data = os.urandom(100_000)
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(data)
    expected = keys_mod.hash_file(mine)
    read.clear()
    assert keys_mod.hash_own_file(mine) == expected and read == []
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    theirs = tmp_path / "theirs.safetensors"
    theirs.write_bytes(data)
    os.chown(theirs, 65534, 65534)
    assert keys_mod.hash_own_file(theirs) == expected and read == [100_000]


def test_running_out_of_descriptors_is_the_processes_trouble_not_the_sources(tmp_path):
    """A source opened with the process at its open-file limit (one uid's sources of thousands of files each, an
    attack review) was a 422 invalid source for whoever asked then; it is a CacheError (503: retry later)."""
    src = write_source(tmp_path / "many", {f"f{i:03d}.json": b"{}" for i in range(200)})
    code = ("import resource, sys\n"
            "from transformd.cache import CacheError, SourceError\n"
            "from transformd.cache.securefs import open_source\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "try:\n"
            "    open_source(sys.argv[1], None).close()\n"
            "except CacheError as e:\n"
            "    print('CacheError', e.api_status(), e)\n"
            "except SourceError as e:\n"
            "    print('SourceError', e.api_status(), e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.startswith("CacheError 503 cannot open "), done.stdout + done.stderr
    assert "open-file limit" in done.stdout and "retry later" in done.stdout
