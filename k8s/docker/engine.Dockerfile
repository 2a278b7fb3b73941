# syntax=docker/dockerfile:1
# The engine service image: `python -m engine_svc`, plus `python -m shared.model_store` for
# the fetch-model init container. Build from the repository root:
#   CPU:  docker build -f k8s/docker/engine.Dockerfile -t duoserve-engine:0.1.0 .
#   CUDA: docker build -f k8s/docker/engine.Dockerfile -t duoserve-engine:0.1.0-cuda \
#           --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# torch's CUDA wheels bring the CUDA libraries; the CUDA base image brings the environment
# the NVIDIA container toolkit reads to mount the driver. Any base with Python >= 3.11, or
# a Debian/Ubuntu base without Python (the distribution's python3 is installed), works.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch's CPU wheels by default; its CUDA wheels for a GPU image.
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
# The pinned dependencies first (with the convert extra the model fetch needs), so that a
# code change does not reinstall them. The package itself is not installed: the code runs
# from /app, where shared/protos.py finds the generated code in /app/gen.
RUN python3 requirements.py pyproject.toml dependencies convert > requirements.txt \
    && python3 requirements.py pyproject.toml dev --only grpcio-tools > protoc-requirements.txt \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
    && python3 -m venv /opt/protoc \
    && /opt/protoc/bin/pip install -r protoc-requirements.txt
COPY protos protos
RUN mkdir gen \
    && find protos -name '*.proto' -exec /opt/protoc/bin/python -m grpc_tools.protoc -I protos \
        --python_out=gen --grpc_python_out=gen {} +
# The C++ CPU kernels (engine_svc/kernels), built here so that the runtime image needs no
# compiler, from one source for each x86-64 level: x86-64-v4 (AVX-512) and x86-64-v3 (AVX2),
# both with every fast path, and plain x86-64; each node loads the best its CPU runs. An image
# of another architecture (built without them) runs plain torch.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY engine_svc engine_svc
COPY shared shared
ENV DUOSERVE_CPU_ARCH=x86-64-v4,x86-64-v3,x86-64 DUOSERVE_KERNEL_CACHE=/opt/duoserve-kernels
RUN mkdir -p /opt/duoserve-kernels \
    && if [ "$(uname -m)" = x86_64 ]; then \
        PATH=/opt/venv/bin:${PATH} PYTHONPATH=/src python -m engine_svc.kernels --build-only; \
    fi

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
COPY --from=build /opt/duoserve-kernels /opt/duoserve-kernels
COPY shared /app/shared
COPY engine_svc /app/engine_svc
# Bytecode now: the root filesystem is read-only at run time.
RUN /opt/venv/bin/python -m compileall -q /app
# HOME is /tmp: the pod mounts a writable emptyDir there (read-only root filesystem).
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    DUOSERVE_CPU_ARCH=x86-64-v4,x86-64-v3,x86-64 \
    DUOSERVE_KERNEL_CACHE=/opt/duoserve-kernels
WORKDIR /app
USER 10001:10001
EXPOSE 50061 8001
# Kubernetes probes the gRPC health service natively; Docker's HEALTHCHECK would need a
# gRPC client in the image and is ignored by Kubernetes.
HEALTHCHECK NONE
ENTRYPOINT ["python", "-m", "engine_svc"]
CMD ["--host", "0.0.0.0"]
