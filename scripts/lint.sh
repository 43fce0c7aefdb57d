#!/usr/bin/env bash
# The quality gates: ruff (lint and format) and mypy, as configured in pyproject.toml. Exits non-zero on any
# finding. Run it inside the project environment (.ci/run: `./scripts/run.sh scripts/lint.sh`);
# it first installs the exact ruff and mypy versions of pyproject.toml's `lint` extra when the
# environment lacks them (requirements/cpu.lock does not list them, so a fresh machine has none).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

pins="$(python - <<'PY'
import tomllib

with open("pyproject.toml", "rb") as f:
    print(" ".join(tomllib.load(f)["project"]["optional-dependencies"]["lint"]))
PY
)"
if ! python - $pins <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    try:
        found = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if found != wanted:
        sys.exit(1)
PY
then
    echo "[lint.sh] installing $pins" >&2
    python -m pip install --quiet $pins 2>&1 | grep -v "is ignored: it is neither" >&2 || true
fi

# All run, so that one pass shows every finding; any failing fails the gate.
status=0
echo "[lint.sh] ruff check" >&2
ruff check . || status=1
echo "[lint.sh] ruff format --check (run 'ruff format .' to fix)" >&2
ruff format --check . || status=1
echo "[lint.sh] mypy" >&2
mypy || status=1
exit $status
