"""``scripts/run.sh``, the one way into the project's environment, on a machine that cannot build it:

- a Python older than 3.11 (sglang 0.5.23 and TRL 1.16 need 3.11) failed only after minutes of pip
  errors; it is named at once, with what to do;
- a ``pip install`` that failed (a full disk mid-way) was ignored (``| grep ... || true``): the
  venv was marked complete when its imports happened to work, and stayed broken until the lock
  changed. Now nothing is marked complete.

A stand-in interpreter plays the Python (a shell script: what it answers is the point, and no
7 GB environment is built here).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

RUN_SH = Path(__file__).resolve().parent.parent / "scripts" / "run.sh"


def stand_in_python(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "python-stand-in"
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_sh(tmp_path: Path, python: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLOUT_PYTHON": str(python), "ROLLOUT_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(["bash", str(RUN_SH), "true"], capture_output=True, text=True, env=env, timeout=60)


def test_a_python_older_than_3_11_is_named_before_anything_is_built(tmp_path: Path) -> None:
    old = stand_in_python(tmp_path, 'case "$*" in *version_info*) exit 1;; esac\necho "3.10.12"\n')
    out = run_sh(tmp_path, old)
    assert out.returncode == 1 and "not Python >= 3.11" in out.stderr and "ROLLOUT_PYTHON" in out.stderr, out.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("venv-*/"))


def test_a_failing_pip_leaves_no_venv_marked_complete(tmp_path: Path) -> None:
    # -m venv makes a venv whose pip fails as a full disk would; every other call is the real Python.
    python = stand_in_python(
        tmp_path,
        'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n'
        '  mkdir -p "$3/bin"\n'
        '  printf \'#!/bin/sh\\necho "ERROR: [Errno 28] No space left on device" >&2\\nexit 1\\n\' > "$3/bin/pip"\n'
        '  chmod +x "$3/bin/pip"\n'
        '  ln -s "$(command -v python3)" "$3/bin/python"\n'
        "  exit 0\n"
        "fi\n"
        'exec python3 "$@"\n',
    )
    out = run_sh(tmp_path, python)
    assert out.returncode == 1, out.stderr
    assert "No space left on device" in out.stderr and "pip could not" in out.stderr, out.stderr
    assert list((tmp_path / "cache").glob("venv-*/.complete")) == []
