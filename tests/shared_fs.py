"""A real network file system on this machine: sshfs over loopback to a private sshd.

As on NFS, every byte crosses a socket, the client caches attributes and listings, and
inotify on the mount does not see changes made on the server side, so a sidecar watching
the mount must poll. See ``shared/docs/SHARED_FS.md``; `.ci/run` installs sshfs and
openssh-server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from helpers import free_port

SSHD = "/usr/sbin/sshd"


@contextmanager
def sshfs_mount(base: Path, *options: str) -> Iterator[tuple[Path, Path]]:
    """Yield ``(server_dir, mount_dir)``: writes to the first are seen through the second."""
    for tool in ("sshfs", "ssh-keygen", "fusermount"):
        if shutil.which(tool) is None:
            raise AssertionError(f"{tool} is missing: apt-get install sshfs openssh-server (.ci/run does)")
    if not os.path.exists(SSHD):
        raise AssertionError(f"{SSHD} is missing: apt-get install openssh-server (.ci/run does)")
    srv, mnt = base / "srv", base / "mnt"
    srv.mkdir(parents=True)
    mnt.mkdir()
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / key)], check=True)
    shutil.copy(base / "client.pub", base / "authorized_keys")
    os.chmod(base / "authorized_keys", 0o600)
    port = free_port()
    (base / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base / 'host'}\n"
        f"AuthorizedKeysFile {base / 'authorized_keys'}\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nSubsystem sftp internal-sftp\n"
        f"PidFile {base / 'sshd.pid'}\n"
    )
    subprocess.run([SSHD, "-f", str(base / "sshd_config"), "-E", str(base / "sshd.log")], check=True)
    try:
        opts = ",".join(
            [f"IdentityFile={base / 'client'}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", *options]
        )
        deadline = time.monotonic() + 30
        while True:
            proc = subprocess.run(
                ["sshfs", "-p", str(port), "-o", opts, f"root@127.0.0.1:{srv}", str(mnt)],
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"sshfs failed: {proc.stderr}\n{(base / 'sshd.log').read_text()}")
            time.sleep(0.5)
        assert os.path.ismount(mnt), "sshfs returned but nothing is mounted"
        yield srv, mnt
    finally:
        subprocess.run(["fusermount", "-u", "-z", str(mnt)], capture_output=True)
        try:
            os.kill(int((base / "sshd.pid").read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass


@contextmanager
def server_frozen(base: Path) -> Iterator[None]:
    """Freeze (SIGSTOP) the sshd processes serving the mount made under ``base``, resumed after:
    every look at the mount blocks in the kernel, as on an NFS mount whose server hangs."""
    master = int((base / "sshd.pid").read_text())
    frozen: list[int] = []

    def children(pid: int) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in found]

    todo = children(master)
    while todo:
        pid = todo.pop()
        todo.extend(children(pid))
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
    assert frozen, "no sshd session serves the mount"
    try:
        yield
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
