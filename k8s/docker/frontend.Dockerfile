# syntax=docker/dockerfile:1
# The frontend service image: `python -m frontend_svc`. CPU only, no model: the frontend
# fetches its tokenizer from an engine. Build from the repository root:
#   docker build -f k8s/docker/frontend.Dockerfile -t duoserve-frontend:0.1.0 .
# BASE_IMAGE takes any base with Python >= 3.11, or a Debian/Ubuntu base without Python
# (the distribution's python3 is installed), as in engine.Dockerfile.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The project's dependencies include torch: its CPU wheels, a fraction of the CUDA ones.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY pyproject.toml k8s/docker/requirements.py ./
# The pinned dependencies first, so that a code change does not reinstall them. The
# package itself is not installed: the code runs from /app, where shared/protos.py finds
# the generated code in /app/gen.
RUN python3 requirements.py pyproject.toml dependencies > requirements.txt \
    && python3 requirements.py pyproject.toml dev --only grpcio-tools > protoc-requirements.txt \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
    && python3 -m venv /opt/protoc \
    && /opt/protoc/bin/pip install -r protoc-requirements.txt
COPY protos protos
RUN mkdir gen \
    && find protos -name '*.proto' -exec /opt/protoc/bin/python -m grpc_tools.protoc -I protos \
        --python_out=gen --grpc_python_out=gen {} +

FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 duoserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home duoserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src/gen /app/gen
COPY shared /app/shared
COPY frontend_svc /app/frontend_svc
# Bytecode now: the root filesystem is read-only at run time.
RUN /opt/venv/bin/python -m compileall -q /app
# HOME is /tmp: the pod mounts a writable emptyDir there (read-only root filesystem).
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /app
USER 10001:10001
EXPOSE 50051 8000
# Kubernetes probes the gRPC health service natively; Docker's HEALTHCHECK would need a
# gRPC client in the image and is ignored by Kubernetes.
HEALTHCHECK NONE
# Flags (--engine, --host, ...) come as arguments: see k8s/base/frontend/deployment.yaml.
ENTRYPOINT ["python", "-m", "frontend_svc"]
