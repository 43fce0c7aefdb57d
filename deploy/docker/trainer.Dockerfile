# Trainer image: TRL + torch + accelerate + this project's trainer hooks (`pip install .[trainer]`),
# no SGLang. It writes checkpoints to the shared volume; rollouts come from the rollout service
# over HTTP.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t rollout-service/trainer:0.1.0 .
#
# torch comes from PyPI (its CUDA build, which also runs on the CPU); dependency versions are
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
RUN pip install -c /tmp/build/src/requirements/cpu.lock "/tmp/build/src[trainer]" \
 && rm -rf /tmp/build
RUN groupadd --gid ${APP_UID} rollout \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin rollout \
 && mkdir -p /checkpoints /models /outputs \
 && chown ${APP_UID}:${APP_UID} /checkpoints /models /outputs
USER ${APP_UID}:${APP_UID}
WORKDIR /home/rollout
# A batch job serves nothing to probe: its exit status is its health (Kubernetes Job, compose
# `service_completed_successfully`).
HEALTHCHECK NONE
CMD ["rollout-service", "--help"]
