"""The sidecar image and the example deployments, checked statically (no container engine on these machines).

Dockerfile: instructions parsed (continuations joined, comments dropped): the base image is a build
argument, the daemon stage (the default target, last) runs as a non-root user, declares the cache and
socket volumes, has a health check and starts ``transformd serve``; its install step is CI's.
Compose and Kubernetes manifests: they parse, and put the engine and transformd side by side sharing
the cache and the socket, the engine's command using ``transformd resolve``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "transformd" / "deploy" / "docker-compose.yaml"
KUBERNETES = REPO / "transformd" / "deploy" / "kubernetes.yaml"

SOCKET_DIR = "/run/transformd"
SOCKET = f"{SOCKET_DIR}/transformd.sock"
CACHE_DIR = "/var/cache/transformd"
MODELS = "/models"


# ---------------------------------------------------------------------------------------------------------------------
# Dockerfile


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments and blank lines dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def stages(instructions: list[tuple[str, str]]) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """Global ARGs (before the first FROM) with their defaults, and the instructions of each stage."""
    global_args: dict[str, str] = {}
    out: list[list[tuple[str, str]]] = []
    for word, rest in instructions:
        if word == "FROM":
            out.append([(word, rest)])
        elif not out:
            assert word == "ARG", f"only ARG may come before FROM, not {word}"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            out[-1].append((word, rest))
    return global_args, out


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


@pytest.fixture(scope="module")
def dockerfile():
    global_args, all_stages = stages(parse_dockerfile(DOCKERFILE.read_text()))
    return global_args, all_stages, all_stages[-1]


def _one(stage: list[tuple[str, str]], word: str) -> str:
    found = [rest for w, rest in stage if w == word]
    assert len(found) == 1, f"{word}: {found}"
    return found[0]


def test_base_image_is_a_build_argument(dockerfile):
    global_args, _, daemon = dockerfile
    assert global_args.get("BASE_IMAGE", "").startswith("python:3.1"), global_args
    assert global_args["BASE_IMAGE"].endswith("-slim")
    image = _one(daemon, "FROM").split()[0]
    assert image == "${BASE_IMAGE}"


def test_documents_rocm_and_cuda_bases():
    text = DOCKERFILE.read_text()
    assert "rocm/pytorch" in text and "gfx94x" in text
    assert "pytorch/pytorch" in text and "CUDA" in text


def test_runs_as_non_root(dockerfile):
    _, _, daemon = dockerfile
    user = [rest for w, rest in daemon if w == "USER"][-1]
    name = user.split(":")[0]
    assert name not in ("root", "0", "")
    run = " ".join(rest for w, rest in daemon if w == "RUN")
    assert name.isdigit() or ("useradd" in run and name in run)


def test_cache_and_socket_are_volumes(dockerfile):
    _, _, daemon = dockerfile
    volumes: list[str] = []
    for w, rest in daemon:
        if w == "VOLUME":
            volumes += exec_form(rest) if rest.startswith("[") else rest.split()
    assert CACHE_DIR in volumes and SOCKET_DIR in volumes
    env = " ".join(rest for w, rest in daemon if w == "ENV")
    assert f"TRANSFORMD_SOCKET={SOCKET}" in env and f"TRANSFORMD_CACHE_DIR={CACHE_DIR}" in env
    assert f"TRANSFORMD_ALLOW_ROOTS={MODELS}" in env


def test_healthcheck_and_entrypoint(dockerfile):
    _, _, daemon = dockerfile
    health = _one(daemon, "HEALTHCHECK")
    options, _, command = health.partition("CMD")
    assert "--interval=" in options and "--timeout=" in options
    assert exec_form(command.strip())[:2] == ["transformd", "health"]
    assert exec_form(_one(daemon, "ENTRYPOINT")) == ["transformd", "serve"]


def _ci_install() -> tuple[str, list[str]]:
    """.ci/run's venv command and pip install arguments."""
    text = (REPO / ".ci" / "run").read_text()
    match = re.search(r"python3 -m venv (\S+) && \S+/pip install (.+?) &&", text)
    assert match, ".ci/run no longer has the 'python3 -m venv X && X/bin/pip install ...' step"
    return match.group(1), shlex.split(match.group(2))


def test_install_step_is_the_one_ci_runs(dockerfile):
    _, ci_pip = _ci_install()
    ci_torch = next(a for a in ci_pip if a.startswith("torch=="))
    _, _, daemon = dockerfile
    args = {rest.partition("=")[0]: rest.partition("=")[2] for w, rest in daemon if w == "ARG"}
    assert args.get("TORCH_REQUIREMENT") == ci_torch, "the image pins the torch CI tests with"
    run = next(rest for w, rest in daemon if w == "RUN" and "pip install" in rest)
    assert re.search(r"python3 -m venv( --system-site-packages)? (\S+)", run)
    pip = shlex.split(run.split("pip install", 1)[1].split("&&")[0])
    ci_flags = [a for a in ci_pip if a.startswith("-") and a != "-e"]
    assert all(flag in pip for flag in ci_flags), (ci_flags, pip)
    assert "${TORCH_REQUIREMENT}" in pip
    assert "-e" not in pip and "--editable" not in pip, "the image installs the package, not an editable checkout"
    assert pip[-1] == "/opt/transformd/src" and any("COPY" == w and "/opt/transformd/src" in r for w, r in daemon)


#: What every engine image the ``engine`` stage is built on already has (vLLM's and SGLang's own requirements): the
#: stage installs transformd with --no-deps, so whatever else its commands import must be on its own pip line.
ENGINE_PROVIDES = {"torch", "triton", "numpy", "safetensors", "tqdm", "httpx", "fastapi", "uvicorn", "huggingface_hub"}
#: A distribution's top-level module, where the two names differ.
MODULE_OF = {"google-re2": "re2", "pydantic-settings": "pydantic_settings", "prometheus-client": "prometheus_client",
             "fastapi-offline": "fastapi_offline"}
#: Refuses to import the modules named in $TRANSFORMD_TEST_ABSENT (an image that lacks them), on PYTHONPATH.
ABSENT_MODULES = """\
import os, sys
_ABSENT = set(filter(None, os.environ.get("TRANSFORMD_TEST_ABSENT", "").split(",")))
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the engine image)", name=name)
sys.meta_path.insert(0, _Absent())
"""


def _module(requirement: str) -> str:
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()
    return MODULE_OF.get(name, name.replace("-", "_"))


def test_engine_image_installs_what_its_commands_import(dockerfile, tmp_path):
    """The engine stage's commands (``transformd resolve``, ``transformd convert --cache-dir --remote --select``)
    run with every dependency of transformd that neither the engine image nor the stage's pip line provides made
    absent: none of them imports one (before: ``convert --remote`` and ``--select`` died on obstore and re2 with
    a traceback, in an image that lacked them)."""
    import os
    import subprocess
    import sys

    from tests.support.s3server import free_port
    from transformd.sample import write_sample_checkpoint

    _, all_stages, _ = dockerfile
    engine = next(st for st in all_stages if st[0][1].endswith(" AS engine"))
    run = next(rest for w, rest in engine if w == "RUN" and "--no-deps" in rest)
    extra = [a for part in run.split("&&")[1:] for a in shlex.split(part.split("pip install", 1)[1])
             if not a.startswith("-")]
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.S | re.M)
    wanted = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)  # (tomllib: Python 3.11 and later)
    assert "torch>=2.4" in wanted and len(wanted) > 10, wanted
    absent = {_module(r) for r in wanted} - ENGINE_PROVIDES - {_module(r) for r in extra}
    assert "fastapi_offline" in absent, absent  # (the daemon's alone: an engine container does not serve)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ABSENT_MODULES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRANSFORMD_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), TRANSFORMD_TEST_ABSENT=",".join(absent),
               AWS_ACCESS_KEY_ID="AK", AWS_SECRET_ACCESS_KEY="secret", AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_EC2_METADATA_DISABLED="true",
               TRANSFORMD_SOCKET=str(tmp_path / "none.sock"))
    src = write_sample_checkpoint(tmp_path / "m", layers=1, experts=2, shards=1)
    commands = {
        "resolve": (["resolve", str(src), "--engine", "vllm", "--select", "model.*"], 1),
        "convert": (["convert", str(src), "--target", "ocp", "--select", "model.*", "--cache-dir",
                     str(tmp_path / "cache"), "--remote", "s3://bucket/p", "--no-daemon", "--device", "cpu"], 0),
    }
    for name, (argv, code) in commands.items():
        done = subprocess.run([sys.executable, "-m", "transformd", *argv], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr, (name, done.stderr)
        assert done.returncode == code, (name, done.returncode, done.stderr)
    assert "upload failed" in done.stderr, done.stderr  # (the bucket was asked: the tier's client imported)


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_health_and_serve_are_commands():
    """The HEALTHCHECK and ENTRYPOINT name commands the CLI has (both registered on the main parser; a broken import fails here, it is not skipped)."""
    from transformd import cli
    from transformd.cli import serve as api_cli
    from transformd.cli import resolve

    parser = cli.build_parser()
    assert parser.parse_args(["health", "--quiet"]).handler is resolve.run_health
    assert parser.parse_args(["serve"]).handler is api_cli.cmd_serve


# ---------------------------------------------------------------------------------------------------------------------
# Example deployments


def _mounts_compose(service: dict) -> dict[str, tuple[str, bool]]:
    """target path -> (source, read_only) of a compose service's short-syntax volumes."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def test_compose_file():
    docs = list(yaml.safe_load_all(COMPOSE.read_text()))
    assert len(docs) == 1
    services = docs[0]["services"]
    daemon, engine = services["transformd"], services["engine"]

    assert daemon["build"]["target"] == "daemon" and "BASE_IMAGE" in daemon["build"]["args"]
    assert daemon["healthcheck"]["test"][1:3] == ["transformd", "health"]
    assert engine["depends_on"]["transformd"]["condition"] == "service_healthy"
    assert daemon["cap_drop"] == ["ALL"] and "no-new-privileges:true" in daemon["security_opt"]

    args = daemon["command"]
    assert args[args.index("--allow-root") + 1] == MODELS
    assert args[args.index("--socket") + 1] == SOCKET

    d, e = _mounts_compose(daemon), _mounts_compose(engine)
    assert d[CACHE_DIR][0] == e[CACHE_DIR][0] and d[CACHE_DIR][0] in docs[0]["volumes"]  # the same named volume
    assert e[CACHE_DIR][1] and not d[CACHE_DIR][1]  # the engine only reads it
    assert d[SOCKET_DIR][0] == e[SOCKET_DIR][0] and d[SOCKET_DIR][0] in docs[0]["volumes"]
    assert d[MODELS] == e[MODELS] and d[MODELS][1]  # same host directory, same path, read-only

    command = " ".join(engine["entrypoint"] + engine["command"])
    assert "transformd resolve /models/" in command and f"--socket {SOCKET}" in command
    assert "vllm serve" in command and "--target ocp" in command
    assert "--engine vllm" in command, "the hook names its engine (issue 44): else a silent misload is refused"
    # `$$` is compose's escape for a `$` the shell must see; a bare `$(` would be a compose interpolation error.
    assert re.search(r"(?<!\$)\$\(", command) is None and "$$(transformd resolve" in command


def test_kubernetes_pod():
    docs = [d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d]
    pod = next(d for d in docs if d["kind"] == "Pod")
    spec = pod["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "transformd")
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: starts first, runs alongside

    assert sidecar["startupProbe"]["exec"]["command"][:2] == ["transformd", "health"]
    assert sidecar["livenessProbe"]["exec"]["command"][:2] == ["transformd", "health"]
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    args = sidecar["args"]
    assert args[args.index("--allow-root") + 1] == MODELS

    def mounts(c: dict) -> dict[str, tuple[str, bool]]:
        return {m["mountPath"]: (m["name"], bool(m.get("readOnly"))) for m in c["volumeMounts"]}

    volumes = {v["name"]: v for v in spec["volumes"]}
    s, e = mounts(sidecar), mounts(engine)
    assert s[CACHE_DIR][0] == e[CACHE_DIR][0] and e[CACHE_DIR][1]
    assert s[SOCKET_DIR][0] == e[SOCKET_DIR][0] and "emptyDir" in volumes[s[SOCKET_DIR][0]]
    assert s[MODELS] == e[MODELS] and s[MODELS][1]
    assert "hostPath" in volumes[s[CACHE_DIR][0]]  # the cache outlives the pod: one conversion per node

    command = " ".join(engine["command"] + engine["args"])
    assert "transformd resolve /models/" in command and f"--socket {SOCKET}" in command
    assert "vllm serve" in command and "--target ocp" in command
    assert "--engine vllm" in command, "the hook names its engine (issue 44): else a silent misload is refused"

    # the remote tier: a bucket URL the library accepts, credentials from a Secret (never a literal in the example)
    env = {v["name"]: v for v in sidecar["env"]}
    assert env["TRANSFORMD_REMOTE"]["value"].startswith("s3://")
    from transformd.remote.tier import Remote
    from transformd.remote.errors import RemoteDeniedError

    try:
        Remote.from_url(env["TRANSFORMD_REMOTE"]["value"])
    except RemoteDeniedError:  # (no credentials where the tests run: the URL itself was accepted)
        pass
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["name"]
    assert not any(e["name"].startswith("AWS_") for e in engine.get("env", []))  # the engine never sees them


# ---------------------------------------------------------------------------------------------------------------------
# The examples work as written on a fresh node (issue 45)


def _pinned(image: str) -> bool:
    """An image named by a version or a digest: a tag other than ``latest`` holding a digit, or ``@sha256:``."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and any(c.isdigit() for c in tag)


def test_every_base_image_is_pinned(dockerfile):
    """``:latest`` gave a different image on every rebuild; the Dockerfile's defaults, the images its comments tell
    to build with, and the examples' build arguments and images are versions."""
    global_args, _, _ = dockerfile
    for name in ("BASE_IMAGE", "ENGINE_IMAGE"):
        assert _pinned(global_args[name]), (name, global_args[name])
    told = re.findall(r"(?:BASE_IMAGE|ENGINE_IMAGE)=(\S+)", DOCKERFILE.read_text())
    assert told and all(_pinned(i) for i in told), told
    compose = yaml.safe_load(COMPOSE.read_text())
    for service in compose["services"].values():
        for value in (service.get("build") or {}).get("args", {}).values():
            if "/" in str(value) or ":" in str(value):
                assert _pinned(value), value
    pod = next(d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d and d["kind"] == "Pod")
    built_here = {"transformd:rocm", "vllm-transformd:rocm"}  # the Dockerfile's targets, built and pushed by the user
    for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        assert c["image"] in built_here or _pinned(c["image"]), c["image"]
    for text in (COMPOSE.read_text(), KUBERNETES.read_text(), DOCKERFILE.read_text()):
        assert ":latest" not in text


def test_kubernetes_cache_is_the_daemons_before_it_starts():
    """The cache hostPath (``DirectoryOrCreate``: root's, 0755 on a fresh node, and fsGroup does not apply to
    hostPath) is given to the daemon's uid by an init container that runs before the daemon; the hub cache, which
    only repo ids need, does not stop the pod on a node without it."""
    pod = next(d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d and d["kind"] == "Pod")
    spec = pod["spec"]
    inits = spec["initContainers"]
    daemon_at = next(i for i, c in enumerate(inits) if c["name"] == "transformd")
    uid, gid = inits[daemon_at]["securityContext"]["runAsUser"], inits[daemon_at]["securityContext"]["runAsGroup"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    cache_volume = next(m["name"] for m in inits[daemon_at]["volumeMounts"] if m["mountPath"] == CACHE_DIR)
    assert volumes[cache_volume]["hostPath"]["type"] == "DirectoryOrCreate"
    owners = [c for c in inits[:daemon_at]
              if any(m["name"] == cache_volume and not m.get("readOnly") for m in c.get("volumeMounts", []))]
    assert len(owners) == 1, "one init container before the daemon owns the cache directory"
    owner = owners[0]
    mount = next(m["mountPath"] for m in owner["volumeMounts"] if m["name"] == cache_volume)
    script = " ".join(owner.get("command", []) + owner.get("args", []))
    assert f"chown {uid}:{gid} {mount}" in script and "-R" not in script, script
    assert "restartPolicy" not in owner, "a plain init container: it ends before the daemon starts"
    context = owner["securityContext"]
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"] and set(context["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}
    for name, v in volumes.items():  # a hostPath the pod needs on every node is made, or is the models' own
        if "hostPath" in v and name != "models":
            assert v["hostPath"].get("type") == "DirectoryOrCreate", (name, v)


def test_compose_cache_volume_is_the_daemons():
    """Compose's cache is a named volume: Docker fills a new one from the image's directory, with its owner (the
    daemon's user); a bind mount of a host directory would be root's, as in Kubernetes."""
    compose = yaml.safe_load(COMPOSE.read_text())
    daemon = compose["services"]["transformd"]
    source = _mounts_compose(daemon)[CACHE_DIR][0]
    assert source in compose["volumes"] and not source.startswith(("/", ".")), source
    _, stages_ = stages(parse_dockerfile(DOCKERFILE.read_text()))
    run = " ".join(rest for w, rest in stages_[-1] if w == "RUN")
    assert re.search(r"chown \S+ " + re.escape(CACHE_DIR), run), "the image's cache directory is the daemon's user's"
