#!/usr/bin/env bash
# Run a command inside the project's environment, building that environment first if needed.
#
#   ./scripts/run.sh pytest -q                      # the test suite
#   ./scripts/run.sh rollout-service demo           # the CPU GRPO demo
#
# The command runs in the caller's directory, so relative paths in it mean what they mean there
# (`rollout-service validate root/step-00000001`, `--out`, `--output-dir`); this script's own
# paths are absolute. The suite and README commands run from the repository root.
#
# The environment is a venv with sglang 0.5.23's CPU-capable dependency set (no CUDA kernel
# packages), TRL and this project, pinned by requirements/cpu.lock. It is cached under
# $ROLLOUT_CACHE_DIR (default ~/.cache/rollout-service) in a folder keyed by a hash of the lock
# file, so it is built once per machine (~7 GB, a few minutes) and reused afterwards.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ROLLOUT_CACHE_DIR:-$HOME/.cache/rollout-service}"
PYTHON="${ROLLOUT_PYTHON:-python3}"
LOCK="$REPO/requirements/cpu.lock"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
    echo "[run.sh] $PYTHON is not Python >= 3.11, which sglang 0.5.23 and TRL 1.16 need: install one and" \
        "point ROLLOUT_PYTHON at it (e.g. ROLLOUT_PYTHON=python3.11)" >&2
    exit 1
}
KEY="$( (cat "$LOCK"; "$PYTHON" -c 'import sys; print(sys.version)'; echo v2) | sha256sum | cut -c1-16)"
VENV="$CACHE/venv-$KEY"

mkdir -p "$CACHE"
exec 9>"$CACHE/venv-$KEY.lock"
flock 9
if [ ! -f "$VENV/.complete" ]; then
    echo "[run.sh] building environment $VENV from requirements/cpu.lock (several minutes, once per machine)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # (pipefail: a pip that fails, a full disk mid-way, stops here, before the venv is marked complete)
    quiet() { grep -v "is ignored: it is neither" >&2 || true; }
    "$VENV/bin/pip" install --quiet --upgrade "pip>=25" "setuptools>=77,<81" wheel 2>&1 | quiet \
        || { echo "[run.sh] pip could not upgrade itself in $VENV; see above" >&2; exit 1; }
    # --no-deps: the lock is complete, and sglang's own metadata asks for CUDA-only kernels.
    "$VENV/bin/pip" install --quiet --no-deps -r "$LOCK" 2>&1 | quiet \
        || { echo "[run.sh] pip could not install requirements/cpu.lock into $VENV; see above" >&2; exit 1; }
    "$VENV/bin/python" -c "import sglang, trl, torch, safetensors, watchdog, fastapi" \
        || { echo "[run.sh] the environment is incomplete; see the pip output above" >&2; exit 1; }
    touch "$VENV/.complete"
fi
# The project itself (editable, no deps): cheap, and points at this checkout.
# (-I: ignore the current directory, which would hide a missing install.)
# Reinstalled too when pyproject.toml changed since (new packages, console commands).
PROJECT_KEY="$REPO $(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if ! "$VENV/bin/python" -I -c "import rollout_service, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(rollout_service.__file__)) == '$REPO' else 1)" 2>/dev/null \
        || [ "$(cat "$VENV/.project-key" 2>/dev/null)" != "$PROJECT_KEY" ]; then
    "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e "$REPO" > "$VENV/install-project.log" 2>&1 \
        || { cat "$VENV/install-project.log" >&2; exit 1; }
    echo "$PROJECT_KEY" > "$VENV/.project-key"
fi
flock -u 9
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
exec "$@"
