"""A stage that runs out of room never yields a copy with a gap of zeros that passes as verified.

On a full tmpfs (a ``/dev/shm`` stage another process filled) ``write`` first returns a short
count, and raises ``ENOSPC`` only on the next try. Before, ``copy_verified`` ignored the count,
hashed the bytes it had asked to write, and cut the file to its size: the missing end read back
as zeros, the digest (of the buffer) matched, and the sidecar handed SGLang a corrupt copy as
verified. The same unchecked write put a shard's header into a rebuilt delta shard.

These run on a real tmpfs of a few pages, mounted in a private mount namespace
(``unshare -m``), so that the kernel itself writes short.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from rollout_service.digest import file_digest

SMALL_FS_BYTES = 256 << 10


def run_on_a_small_tmpfs(mountpoint: Path, script: str) -> dict:
    """Run ``script`` (Python) with a ``SMALL_FS_BYTES`` tmpfs mounted at ``mountpoint`` in a
    private mount namespace; return the JSON it prints last."""
    mountpoint.mkdir()
    shell = f'mount -t tmpfs -o size={SMALL_FS_BYTES} tmpfs {mountpoint} && exec {sys.executable} -c "$SCRIPT"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        env={**__import__("os").environ, "SCRIPT": textwrap.dedent(script)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_writes_short_on_a_full_tmpfs_and_write_all_raises(tmp_path: Path) -> None:
    out = run_on_a_small_tmpfs(
        tmp_path / "small",
        f"""
        import errno, json, os
        from rollout_service.full_writes import pwrite_all, write_all
        fd = os.open("{tmp_path / "small"}/a", os.O_WRONLY | os.O_CREAT)
        short = os.write(fd, bytes({2 * SMALL_FS_BYTES}))
        os.ftruncate(fd, 0)
        result = {{"short": short}}
        for name, call in [("write_all", lambda: write_all(fd, bytes({2 * SMALL_FS_BYTES}))),
                           ("pwrite_all", lambda: pwrite_all(fd, bytes({2 * SMALL_FS_BYTES}), 0))]:
            os.ftruncate(fd, 0)
            try:
                call()
                result[name] = "wrote"
            except OSError as exc:
                result[name] = errno.errorcode[exc.errno]
        print(json.dumps(result))
        """,
    )
    assert 0 < out["short"] < 2 * SMALL_FS_BYTES  # the kernel did write short, without an error
    assert out["write_all"] == "ENOSPC" and out["pwrite_all"] == "ENOSPC"


def test_a_copy_into_a_full_stage_fails_instead_of_passing_with_zeros(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    src = root / "model.safetensors"
    src.write_bytes(bytes(range(256)) * (2 * SMALL_FS_BYTES // 256))  # one copy chunk, twice the room
    size, digest = src.stat().st_size, file_digest(src)
    dst = tmp_path / "small" / "model.safetensors"
    out = run_on_a_small_tmpfs(
        tmp_path / "small",
        f"""
        import json
        from pathlib import Path
        from rollout_service.untrusted_files import Deadline, copy_verified
        from rollout_service.digest import file_digest
        try:
            copy_verified(Path("{root}"), Path("{src}"), Path("{dst}"), where="shard", size={size},
                          digest="{digest}", deadline=Deadline(None))
            print(json.dumps({{"copied": True, "same": file_digest(Path("{dst}")) == "{digest}"}}))
        except OSError as exc:
            print(json.dumps({{"copied": False, "error": exc.strerror}}))
        """,
    )
    assert out == {"copied": False, "error": "No space left on device"}, out
