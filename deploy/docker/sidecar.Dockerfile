# Slim sidecar image: the project's base install (no torch, no SGLang) plus huggingface_hub. It
# watches the checkpoint volume and loads new checkpoints into an SGLang server reached over HTTP.
# huggingface_hub: when SGLang serves a Hub id, the sidecar finds that model's files in SGLang's
# download cache (mounted read-only, same HF_HOME; rollout_service/sidecar/served_model.py) and
# checks every checkpoint against its tensors; without it nothing would load (`no_reference`).
#
#   docker build -f deploy/docker/sidecar.Dockerfile -t rollout-service/sidecar:0.1.0 .
#
# Configure it with ROLLOUT_* variables (every flag of `rollout-service sidecar` has one), e.g.
# ROLLOUT_CHECKPOINT_PATH, ROLLOUT_SGLANG_URL, ROLLOUT_HOST=0.0.0.0, ROLLOUT_TOKEN (from a secret
# at run time: none is baked in). Dependency versions are those of requirements/cpu.lock.

ARG PYTHON_VERSION=3.11.14
ARG DEBIAN_SUITE=bookworm
ARG APP_UID=10001

FROM python:${PYTHON_VERSION}-slim-${DEBIAN_SUITE}
ARG APP_UID
LABEL org.opencontainers.image.title="rollout-service/sidecar" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="rollout-service sidecar: loads checkpoints into SGLang"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY . /tmp/build/src
RUN pip install -c /tmp/build/src/requirements/cpu.lock /tmp/build/src huggingface_hub \
 && python -c "import huggingface_hub" \
 && python -c "import importlib.util as u, sys; heavy = [m for m in ('torch', 'sglang') if u.find_spec(m)]; sys.exit(f'the slim sidecar must not contain {heavy}' if heavy else 0)" \
 && rm -rf /tmp/build
RUN groupadd --gid ${APP_UID} rollout \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --create-home --shell /usr/sbin/nologin rollout \
 && mkdir -p /checkpoints /stage /home/rollout/.cache/huggingface \
 && chown ${APP_UID}:${APP_UID} /checkpoints /stage \
 && chown -R ${APP_UID}:${APP_UID} /home/rollout/.cache
USER ${APP_UID}:${APP_UID}
WORKDIR /home/rollout
EXPOSE 8100
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % (os.environ.get('ROLLOUT_PORT') or 8100), timeout=4)"]
CMD ["rollout-service", "sidecar"]
