# nograd container image: CPU PyTorch by default, multi-stage, non-root.
#
#   docker build -t nograd:latest .                                   # CPU torch from the PyTorch CPU index
#   docker build -t nograd:latest --build-arg TORCH_WHEEL_DIR=wheels .  # torch from ./wheels (no PyTorch index)
#   docker build -t nograd:cuda --build-arg VARIANT=cuda \
#       --build-arg BASE_IMAGE=docker.io/nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 .   # CUDA (see docs/container.md)
#
# The base image only has to provide `python3` (>= 3.11) with the venv module, or Debian/Ubuntu's apt to
# install it: docker.io/library/python:3.11-slim (python in /usr/local/bin), a Debian bookworm rootfs
# (/usr/bin/python3, as scripts/container_test.sh builds) and the nvidia/cuda Ubuntu images all work.
ARG BASE_IMAGE=docker.io/library/python:3.11-slim

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
# CUDA/Ubuntu bases ship no python3: install it there; a no-op on python:3.11-slim and Debian rootfs.
RUN if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# ---------------------------------------------------------------------------------------------------
# The dependency list alone, read from pyproject.toml: the builder copies only this file, so edits to
# other parts of pyproject.toml (version, tool settings, dev extras) keep the dependency layer cached.
FROM base AS requirements
WORKDIR /src
COPY pyproject.toml ./
# The onnx extra is included: the shipped models' engine = "auto" builds ONNX Runtime engines.
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["onnx"]))' \
        > requirements.txt

# ---------------------------------------------------------------------------------------------------
FROM base AS builder
# cpu | cuda: picks the PyTorch index below (and the check that the installed torch matches).
ARG VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128
# A folder in the build context holding a torch wheel (e.g. `wheels`): installs torch from it instead
# of the PyTorch index, for builds that cannot reach that index.
ARG TORCH_WHEEL_DIR=
# Drop torch's C++ test binaries and headers (~190 MB); they are only used to build extensions, and
# the runtime image has no compiler anyway. Set to 0 to keep them.
ARG TRIM_TORCH=1
# Optional PyPI mirror / proxy settings; empty values are ignored by pip. HTTP(S)_PROXY and NO_PROXY
# are predefined build args and reach pip as usual.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv
WORKDIR /src

# Layer 1: torch alone (the big one), pinned by constraints.txt, never from PyPI's CUDA build on cpu.
# The bind mount reads the wheel folder without baking it into a layer; without TORCH_WHEEL_DIR it
# mounts constraints.txt only so the cache key does not depend on the rest of the build context.
COPY constraints.txt ./
RUN --mount=type=bind,source=${TORCH_WHEEL_DIR:-constraints.txt},target=/tmp/torch-src \
    set -eu; \
    case "$VARIANT" in \
        cpu) index="$TORCH_INDEX_URL" ;; \
        cuda) index="$TORCH_CUDA_INDEX_URL" ;; \
        *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    if [ -n "$TORCH_WHEEL_DIR" ]; then \
        pip install --no-cache-dir --no-deps --no-index --find-links /tmp/torch-src -c constraints.txt torch; \
    else \
        pip install --no-cache-dir --no-deps --index-url "$index" -c constraints.txt torch; \
    fi

# Layer 2: the rest of the dependencies (no nograd code yet, so editing nograd/ does not reinstall them).
# torch is already there and satisfies the pin; its own dependencies come from PyPI. Then check the
# torch build matches VARIANT, and trim it.
COPY --from=requirements /src/requirements.txt ./
RUN set -eu; \
    pip install --no-cache-dir -c constraints.txt -r requirements.txt; \
    python3 -c 'import sys, torch; cuda = torch.version.cuda; print("torch", torch.__version__, "cuda", cuda); \
sys.exit(0 if (sys.argv[1] == "cpu") == (cuda is None) else "torch build does not match VARIANT")' "$VARIANT"; \
    if [ "$TRIM_TORCH" = 1 ]; then \
        site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
        rm -rf "$site/torch/test" "$site/torch/include" "$site/torch/bin"/*Test "$site/torch/bin"/test_*; \
        python3 -c 'import torch; torch.ones(2) @ torch.ones(2)'; \
    fi

# Layer 3: the app itself, built as a wheel without its dependencies. The runtime stage installs it on
# top of the venv layer, so editing nograd/ leaves the big venv layer cached.
COPY pyproject.toml README.md* ./
COPY nograd/ ./nograd/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . && rm -rf build ./*.egg-info

# ---------------------------------------------------------------------------------------------------
FROM base AS runtime
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/nograd \
        --shell /usr/sbin/nologin nograd
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    NOGRAD_HOST=0.0.0.0 \
    NOGRAD_PORT=8000 \
    NOGRAD_GRPC_PORT=8001 \
    NOGRAD_MODEL_REPOSITORY=/srv/nograd/models
# The venv with every dependency (one big layer that app changes do not touch), then the app package
# and its `nograd` console script from the builder's wheel, then the model repository.
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps --no-index --disable-pip-version-check /tmp/dist/*.whl \
    && rm -rf /tmp/dist
WORKDIR /srv/nograd
COPY models/ /srv/nograd/models/
USER 10001:10001
EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('NOGRAD_PORT', '8000'), timeout=4)"]
CMD ["/opt/venv/bin/nograd"]
