# Rollout image: an SGLang server plus this project (its `rollout-service` CLI and sidecar).
#
# Two targets, built from the repository root:
#   gpu (the default, last stage): SGLang's own CUDA image, pinned by SGLANG_VERSION.
#     docker build -f deploy/docker/rollout.Dockerfile -t rollout-service/rollout:0.1.0 .
#   cpu: Python slim + the pinned CPU environment (requirements/cpu.lock) + the project's
#     sgl_kernel stand-in, for the tiny CPU demo and development clusters.
#     docker build -f deploy/docker/rollout.Dockerfile --target cpu -t rollout-service/rollout-cpu:0.1.0 .
#
# The default command, `rollout-service serve`, runs SGLang and its sidecar as one supervised unit
# configured by ROLLOUT_* variables (compose's `cpu` profile runs it so); compose's `gpu` profile
# and Kubernetes override it to run SGLang alone (`rollout-service sglang -- ...`, which starts
# `sglang.launch_server` with its API key kept off the command line and out of its log) beside
# the slim sidecar image. No secrets are baked in:
# the sidecar token comes from ROLLOUT_TOKEN at run time.

ARG SGLANG_VERSION=0.5.23
ARG PYTHON_VERSION=3.11.14
ARG DEBIAN_SUITE=bookworm
ARG APP_UID=10001

# ---------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN_SUITE} AS cpu
ARG SGLANG_VERSION
ARG APP_UID
LABEL org.opencontainers.image.title="rollout-service/rollout-cpu" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="SGLang ${SGLANG_VERSION} on the CPU + rollout-service"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY requirements/cpu.lock /tmp/build/cpu.lock
# --no-deps: the lock is complete, and sglang's metadata asks for CUDA-only kernel packages
# (the same install as scripts/run.sh).
RUN pip install --no-deps -r /tmp/build/cpu.lock \
 && python -c "import importlib.metadata as m, sys; v = m.version('sglang'); sys.exit(0 if v == '${SGLANG_VERSION}' else f'cpu.lock has sglang {v}, expected ${SGLANG_VERSION}')"
COPY . /tmp/build/src
RUN pip install --no-deps /tmp/build/src \
 && ln -s "$(python -c 'from rollout_service.sglang_launcher import CPU_SHIMS_DIR; print(CPU_SHIMS_DIR)')" /opt/rollout-cpu-shims \
 && rm -rf /tmp/build
# What `rollout-service serve --device cpu` sets for SGLang, set for the whole image so that
# `rollout-service sglang -- --device cpu ...` works as well (Kubernetes cpu-dev overlay).
ENV SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=/opt/rollout-cpu-shims
RUN groupadd --gid ${APP_UID} rollout \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin rollout \
 && mkdir -p /checkpoints /models /outputs /stage /home/rollout/.cache/huggingface \
 && chown ${APP_UID}:${APP_UID} /checkpoints /models /outputs /stage \
 && chown -R ${APP_UID}:${APP_UID} /home/rollout/.cache
USER ${APP_UID}:${APP_UID}
WORKDIR /home/rollout
EXPOSE 30000 8100
# Alive, not ready: `rollout-service liveness` asks the sidecar first and counts SGLang alive while a
# weight load runs (SGLang's /health waits on the load), else asks /health; the ports follow
# `serve`'s ROLLOUT_PORT and ROLLOUT_SIDECAR_PORT. Each of its two calls gets 4 s (8 s in all).
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
  CMD rollout-service liveness --timeout 4 --sglang-url "http://127.0.0.1:${ROLLOUT_PORT:-30000}" \
      --sidecar-url "http://127.0.0.1:${ROLLOUT_SIDECAR_PORT:-8100}"
CMD ["rollout-service", "serve"]

# ---------------------------------------------------------------------------------------------
FROM lmsysorg/sglang:v${SGLANG_VERSION} AS gpu
ARG SGLANG_VERSION
ARG APP_UID
LABEL org.opencontainers.image.title="rollout-service/rollout" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="SGLang ${SGLANG_VERSION} (CUDA) + rollout-service"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -c "import sglang, sys; v = sglang.__version__; sys.exit(0 if v == '${SGLANG_VERSION}' else f'base image has sglang {v}, expected ${SGLANG_VERSION}')"
COPY . /tmp/build/src
# Every package the base image ships stays at its version (SGLang's tested set): the project's
# few extra dependencies are added around them, and a conflict fails the build.
RUN python3 -m pip list --format=freeze > /tmp/build/constraints.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -c /tmp/build/constraints.txt /tmp/build/src \
 && rm -rf /tmp/build
RUN groupadd --gid ${APP_UID} rollout \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin rollout \
 && mkdir -p /checkpoints /models /outputs /stage /home/rollout/.cache/huggingface \
 && chown ${APP_UID}:${APP_UID} /checkpoints /models /outputs /stage \
 && chown -R ${APP_UID}:${APP_UID} /home/rollout/.cache
USER ${APP_UID}:${APP_UID}
WORKDIR /home/rollout
EXPOSE 30000 8100
# Alive, not ready: `rollout-service liveness` asks the sidecar first and counts SGLang alive while a
# weight load runs (SGLang's /health waits on the load), else asks /health; the ports follow
# `serve`'s ROLLOUT_PORT and ROLLOUT_SIDECAR_PORT. Each of its two calls gets 4 s (8 s in all).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
  CMD rollout-service liveness --timeout 4 --sglang-url "http://127.0.0.1:${ROLLOUT_PORT:-30000}" \
      --sidecar-url "http://127.0.0.1:${ROLLOUT_SIDECAR_PORT:-8100}"
CMD ["rollout-service", "serve"]
