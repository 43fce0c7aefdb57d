# Trainer image: TRL + torch + accelerate + this project's trainer hooks (`pip install
# .[trainer,examples]`), no SGLang. The GPU training entry point, examples/grpo_tldr_gpu.py, is at
# /opt/rollout-service/examples/ (compose's and Kubernetes' GPU trainers run it). It writes
# checkpoints to the shared volume; rollouts come from the rollout service over HTTP.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t rollout-service/trainer:0.1.0 .
#
# torch comes from PyPI (its CUDA 13.0 build, which needs NVIDIA driver >= 580 on a GPU and also
# runs on the CPU; for an older driver build FROM an image whose torch matches it, see README
# "Install on GPU machines"); dependency versions are
# those of requirements/cpu.lock. The same base image as the CPU rollout image, so
# `rollout-service make-tiny-model` builds the identical tiny model in both.

ARG PYTHON_VERSION=3.11.14
ARG DEBIAN_SUITE=bookworm
ARG APP_UID=10001

FROM python:${PYTHON_VERSION}-slim-${DEBIAN_SUITE}
ARG APP_UID
LABEL org.opencontainers.image.title="rollout-service/trainer" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="TRL GRPO trainer with rollout-service hooks"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY . /tmp/build/src
RUN pip install -c /tmp/build/src/requirements/cpu.lock "/tmp/build/src[trainer,examples]" \
 && mkdir -p /opt/rollout-service && cp -r /tmp/build/src/examples /opt/rollout-service/examples \
 && rm -rf /tmp/build
RUN groupadd --gid ${APP_UID} rollout \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin rollout \
 && mkdir -p /checkpoints /models /outputs /home/rollout/.cache/huggingface \
 && chown ${APP_UID}:${APP_UID} /checkpoints /models /outputs \
 && chown -R ${APP_UID}:${APP_UID} /home/rollout/.cache
USER ${APP_UID}:${APP_UID}
WORKDIR /home/rollout
# A batch job serves nothing to probe: its exit status is its health (Kubernetes Job, compose
# `service_completed_successfully`).
HEALTHCHECK NONE
CMD ["rollout-service", "--help"]
