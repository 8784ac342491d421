# syntax=docker/dockerfile:1
#
# transformd sidecar image: `transformd serve` on the unix socket /run/transformd/transformd.sock,
# its cache in /var/cache/transformd, sources accepted under /models.
#
#   docker build -t transformd .                                   # CPU (python:3.11.11-slim)
#   docker build -t transformd:rocm \                              # AMD gfx94x (MI300X, MI325X)
#       --build-arg BASE_IMAGE=rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0 --build-arg TORCH_REQUIREMENT= .
#   docker build -t transformd:cuda \                              # NVIDIA (Hopper)
#       --build-arg BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime --build-arg TORCH_REQUIREMENT= .
#
# Every image is pinned to a version, so a rebuild gets what was built before; move a pin on purpose (the
# engine images to the engine versions you run).
#
# BASE_IMAGE: any image with python3 (>= 3.10). The GPU bases (ROCm PyTorch, CUDA PyTorch) carry the
# PyTorch build for their platform: an empty TORCH_REQUIREMENT keeps it (the virtual environment is
# created with --system-site-packages, so it sees the base's torch). On the slim base torch is
# installed from the package index; set TORCH_INDEX_URL to PyTorch's CPU wheel index for a small
# CPU-only image (the default torch wheel carries the CUDA libraries).
#
# The install step is the one CI runs (.ci/run: `python3 -m venv .venv && .venv/bin/pip install -q
# torch==2.13.0 -e '.[test]'`), without the test extras and not editable.
#
# Run (GPU on ROCm): docker run --device /dev/kfd --device /dev/dri --group-add video \
#   -v /srv/models:/models:ro -v transformd-cache:/var/cache/transformd -v transformd-run:/run/transformd transformd:rocm
#
# A second target, `engine`, is an inference engine image with the transformd client added, so the
# engine's command can run `transformd resolve` (see transformd/deploy/):
#   docker build --target engine --build-arg ENGINE_IMAGE=rocm/vllm:rocm6.4.1_vllm_0.9.1_20250715 -t vllm-transformd .
# BuildKit (the default builder) builds only the stages the chosen target needs.

ARG BASE_IMAGE=python:3.11.11-slim
ARG ENGINE_IMAGE=vllm/vllm-openai:v0.9.2

# ---- the source tree, once (see .dockerignore) --------------------------------------------------------------------
FROM scratch AS src
COPY . /src

# ---- engine + client: `transformd resolve` inside the engine's own Python (its torch, httpx, tqdm) --------------------
FROM ${ENGINE_IMAGE} AS engine
COPY --from=src /src /opt/transformd/src
# --no-deps: keep the engine's torch/triton builds; add only what transformd's CLI imports that engines lack
# (google-re2: convert --select; obstore: convert --remote, a conversion here shared through the bucket).
RUN python3 -m pip install -q --no-cache-dir --no-deps /opt/transformd/src \
 && python3 -m pip install -q --no-cache-dir "blake3>=0.4" "pydantic-settings>=2.2" "prometheus-client>=0.20" \
        "google-re2>=1.1" "obstore>=0.12,<0.13"

# ---- the daemon (default target: last stage) ------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS daemon
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG TORCH_INDEX_URL=
ARG UID=10001
ARG GID=10001

ENV PATH=/opt/transformd/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRANSFORMD_SOCKET=/run/transformd/transformd.sock \
    TRANSFORMD_CACHE_DIR=/var/cache/transformd \
    TRANSFORMD_ALLOW_ROOTS=/models \
    TRANSFORMD_DEVICE=auto

COPY --from=src /src /opt/transformd/src
RUN python3 -m venv --system-site-packages /opt/transformd/venv \
 && /opt/transformd/venv/bin/pip install -q --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        ${TORCH_REQUIREMENT} /opt/transformd/src \
 && /opt/transformd/venv/bin/transformd --version

# Non-root: the daemon needs only its cache, its socket directory and read access to /models.
# (On ROCm the user also needs the host's video/render groups: --group-add at run time.)
RUN groupadd --system --gid "${GID}" transformd \
 && useradd --system --uid "${UID}" --gid "${GID}" --home-dir /var/cache/transformd --shell /usr/sbin/nologin transformd \
 && mkdir -p /var/cache/transformd /run/transformd /models \
 && chown "${UID}:${GID}" /var/cache/transformd /run/transformd \
 && chmod 0770 /run/transformd

VOLUME ["/var/cache/transformd", "/run/transformd"]
USER transformd
WORKDIR /var/cache/transformd

HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["transformd", "health", "--quiet"]

ENTRYPOINT ["transformd", "serve"]
CMD []
