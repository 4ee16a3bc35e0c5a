# syntax=docker/dockerfile:1
# megatron_lite training image: CUDA PyTorch + DeepSpeed (single node and multi-node) + this package.
#
#   docker build -t megatron_lite .
#   docker run --rm megatron_lite                                   # prints python train.py --help
#   docker run --gpus all --ipc=host -v $PWD/data:/workspace/data -v $PWD/runs:/workspace/runs \
#       megatron_lite deepspeed train.py --config configs/coca_350m.yml
#
# Build args:
#   FLASH_ATTN=1                 also build flash-attn (model.attention.backend=flash); compiles CUDA code
#   FLASH_ATTN_VERSION, MAX_JOBS  its version and the compile parallelism (each job needs a few GB of RAM)
#   USER_UID, USER_GID           uid/gid of the non-root user; match your host user so bind mounts are writable
# The guide: docs/run_at_scale.md. tests/test_docker.py lints this file and checks it against the repo.

# torch 2.13.0 built for CUDA 13.0 (the CUDA of torch 2.13's PyPI wheels; host driver R580 or newer), cuDNN 9.
# "devel" carries nvcc, which DeepSpeed needs to JIT-compile its CUDA ops (FusedAdam, ...) and flash-attn to build.
# Its torch version must equal the torch pin in constraints.txt (tests/test_docker.py checks the tag, the build
# checks the installed torch). For an older driver: --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-devel
# Any base with `python` (3.10+), pip and the pinned torch works: docker/build_local.py builds a CPU one from Debian
# (torch from a wheel) without Docker Hub, and CI builds and runs this Dockerfile on it (tests/test_image.py).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-devel
FROM ${BASE_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MAX_JOBS=8
ARG RUN_AS=trainer
ARG USER_UID=1000
ARG USER_GID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Harmless for the base image's conda Python; lets pip install if a base ships an "externally managed" one.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# build-essential + libaio-dev: DeepSpeed's JIT ops (libaio for ZeRO-Infinity NVMe offload);
# openssh-client/server + pdsh: DeepSpeed's default multi-node launcher (pdsh over ssh).
# apt packages are not version-pinned: the base tag fixes the Ubuntu release, and Ubuntu drops superseded
# package versions from its archive, so exact apt pins would break rebuilds. Python packages are pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential \
        libaio-dev \
        openssh-client \
        openssh-server \
        pdsh \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace

# Dependencies first, in a layer that changes only with pyproject.toml, constraints.txt or docker/: install the
# package (editable) with the same constraints file CI uses, against a placeholder package and README, and
# fail the build if the base image's torch or any installed version differs from constraints.txt.
COPY pyproject.toml constraints.txt ./
COPY docker/ docker/
RUN python docker/check_versions.py --torch-only \
    && mkdir megatron_lite \
    && touch megatron_lite/__init__.py README.md \
    && python -m pip install --no-cache-dir -c constraints.txt -e . \
    && python docker/check_versions.py \
    && rm -rf megatron_lite README.md

# Optional flash-attn: needs torch at build time (--no-build-isolation) and nvcc (the devel base).
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
        MAX_JOBS="${MAX_JOBS}" python -m pip install --no-cache-dir --no-build-isolation -c constraints.txt \
            "flash-attn==${FLASH_ATTN_VERSION}" \
        && python -c "import flash_attn; print('flash-attn', flash_attn.__version__)" \
        && python docker/check_versions.py; \
    fi

COPY megatron_lite/ megatron_lite/
COPY train.py README.md ./
COPY configs/ configs/
COPY tools/ tools/
COPY data/ data/

# Non-root user (an existing account with the same uid, e.g. Ubuntu 24.04's "ubuntu", is replaced).
# It owns the three volume mount points, so anonymous volumes are writable too.
RUN if getent passwd "${USER_UID}" > /dev/null; then userdel --remove "$(getent passwd "${USER_UID}" | cut -d: -f1)"; fi \
    && if ! getent group "${USER_GID}" > /dev/null; then groupadd --gid "${USER_GID}" "${RUN_AS}"; fi \
    && useradd --no-log-init --create-home --shell /bin/bash --uid "${USER_UID}" --gid "${USER_GID}" "${RUN_AS}" \
    && mkdir -p /workspace/data /workspace/runs /workspace/wandb \
    && chown -R "${USER_UID}:${USER_GID}" /workspace/data /workspace/runs /workspace/wandb \
    && chown "${USER_UID}:${USER_GID}" /workspace \
    && chmod 0755 docker/sshd.sh

# data.cache_dir (tokenizer, shards, index) and Hugging Face downloads live under /workspace/data;
# --run-dir (checkpoints, metrics.jsonl, config.yml, wandb run files) defaults to /workspace/runs/<config name>;
# wandb's own cache, settings and artifact staging go to /workspace/wandb.
ENV PYTHONUNBUFFERED=1 \
    HF_HOME=/workspace/data/cache/huggingface \
    WANDB_CACHE_DIR=/workspace/wandb/cache \
    WANDB_CONFIG_DIR=/workspace/wandb/config \
    WANDB_DATA_DIR=/workspace/wandb/data \
    SSH_PORT=2222

USER ${RUN_AS}
VOLUME ["/workspace/data", "/workspace/runs", "/workspace/wandb"]
# The unprivileged sshd of docker/sshd.sh (multi-node runs with the pdsh launcher; see docs/run_at_scale.md).
EXPOSE 2222

CMD ["python", "train.py", "--help"]
