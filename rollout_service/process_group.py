"""A child process in its own process group: start it, wait for an HTTP endpoint, stop the group.

`ProcessGroup` is the one way this project runs a server process (SGLang in the launcher, `serve`
in the demo and the tests, sidecars in the tests): the process leads a new session, so it and
every child it forks share one process group; its output goes to a log file; `wait_http` polls an
endpoint until it answers and, when the process exits first or the time runs out, raises an error
that holds the last lines of the log; `stop` terminates the whole group (SIGTERM, then SIGKILL),
and also any process group a descendant started of its own (`serve` starts SGLang in one).

This module imports neither torch nor sglang: the slim sidecar container imports it.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from .redaction import redact_text

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 256 * 1024
"""The most of a log's end any reader takes (its last lines, the last error in it)."""
PROGRESS_EVERY_S = 10.0
POLL_S = 0.5


class ProcessStartError(RuntimeError):
    """A started process did not serve its endpoint: it exited first or the wait timed out."""


class ProcessExitedError(ProcessStartError):
    """The process exited before its endpoint answered."""


class StartTimeoutError(ProcessStartError, TimeoutError):
    """The endpoint did not answer in time (the process is still running)."""


def kill_me_with_parent() -> None:
    """In the child before exec: SIGKILL this process when the thread that started it dies.

    So a killed test run or supervisor never leaves a server behind (Linux only; a no-op
    elsewhere). The server's own children are in its process group and are stopped with it.
    """
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _group_listed(pgid: int) -> bool:
    """Whether any process (a zombie too) is still in group `pgid` (one this process may not
    signal counts as there)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` is alive; zombies do not count.

    A zombie has exited and holds nothing but its process-table entry: waiting for one to go away
    is waiting for its parent to reap it, which never happens when that parent is this process
    (``serve`` as a container's PID 1 or a child subreaper inherits the orphans of the server it
    stopped) and is not reaping. Without ``/proc`` (not Linux) zombies count as alive."""
    if not _group_listed(pgid):
        return False
    members = _group_members({pgid})
    if members is None or not members:  # no /proc, or the group ended since killpg: ask again next time
        return True
    return any(state != "Z" for _pid, _ppid, state in members)


ZOMBIE_SETTLE_S = 2.0
"""How long `ProcessGroup.stop` waits for a stopped group's zombies to be reaped by their parent."""


def _group_members(pgids: set[int]) -> list[tuple[int, int, str]] | None:
    """(pid, parent pid, state) of every process in the process groups `pgids`, from
    ``/proc/<pid>/stat``; None when ``/proc`` cannot be listed."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                text = f.read().decode("ascii", errors="replace")
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[2].lstrip("-").isdigit() and int(fields[2]) in pgids:
            found.append((int(name), int(fields[1]), fields[0]))
    return found


def reap_orphans(pgids: set[int], exclude: int | None = None) -> int:
    """Reap the zombies of process groups `pgids` whose parent is this process; returns how many.

    When this process is PID 1 (a container whose command is ``rollout-service serve``, no init)
    or a child subreaper, the children of a server it started are re-parented to it once the
    server's main process dies, and their zombies stay until it reaps them. Only those are waited
    for, by pid: a wait for any child would steal the exit status of processes that other code
    (``subprocess``) waits for. `exclude` is the server's main process, which its ``Popen`` reaps."""
    me = os.getpid()
    reaped = 0
    for pid, ppid, state in _group_members(pgids) or ():
        if ppid != me or state != "Z" or pid == exclude:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped += 1
        except ChildProcessError:
            pass
    return reaped


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to every process of group `pgid`; a group that is gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def descendant_groups(pid: int) -> set[int]:
    """The process groups of `pid`'s descendants (Linux /proc; empty elsewhere), `pid`'s own excluded."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return set()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:  # bytes: a process name need not be UTF-8 (Linux cuts it at 15 bytes, mid-character too)
            line = (entry / "stat").read_bytes().decode("ascii", "replace")
        except OSError:
            continue
        fields = line[line.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        groups[int(entry.name)] = int(fields[2])
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        current = todo.pop()
        if current in groups:
            found.add(groups[current])
        todo.extend(children.get(current, []))
    found.discard(groups.get(pid, pid))
    return found


def log_end(path: str | os.PathLike[str], max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of the log file at ``path``, credentials redacted
    (:func:`~rollout_service.redaction.redact_text`: SGLang logs its own ``api_key``).

    Never blocks and never reads more: opened non-blocking (a FIFO whose writer died would block
    a plain open forever; ``--sglang-log /dev/stdout`` is a pipe or a terminal), and nothing is
    read from what is not a regular file ("" then, logged once per path). Raises ``OSError``
    when the file cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # links are fine: logs may be links
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            if str(path) not in _NOT_READ:
                _NOT_READ.add(str(path))
                logger.warning("log %s is not a regular file (a pipe, a terminal, a device): its end is not read", path)
            return ""
        start = max(0, info.st_size - max_bytes)
        data = b""
        while len(data) < max_bytes:  # pread may return less than asked (network file systems)
            chunk = os.pread(fd, max_bytes - len(data), start + len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if start > 0:  # a line cut at its start could hold the end of a credential whose name was cut off
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return redact_text(data.decode("utf-8", errors="replace"))


_NOT_READ: set[str] = set()
"""Logs found not to be regular files (warned about once)."""


def log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    """The last `n` lines of the log file at `path` ("" when there is none yet, or it cannot be
    read), as :func:`log_end` reads it."""
    try:
        text = log_end(path)
    except OSError:
        return ""
    return "".join(text.splitlines(keepends=True)[-n:])


def _total_size(paths: Sequence[Path]) -> int:
    total = 0
    for path in paths:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


class ProcessGroup:
    """One command run as the leader of its own process group, its output appended to `log_path`.

    Arguments:
        argv: the command line.
        log_path: file that receives the process's stdout and stderr (appended to).
        name: what error messages and log lines call the process (e.g. "SGLang server").
        env: the full environment of the process (default: this process's).
        cwd: its working directory.
        die_with_parent: SIGKILL the process when the thread that started it dies
            (`kill_me_with_parent`).
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        name: str = "process",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.name = name
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the main process (also the process-group id), or None before `start()`."""
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit code once the main process has exited, else None."""
        return self.process.poll() if self.process is not None else None

    def start(self) -> None:
        """Launch the process in a new session; returns at once (see `wait_http`)."""
        if self.is_running():
            raise RuntimeError(f"{self.name} already running with pid {self.pid}; stop() it first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=kill_me_with_parent if self.die_with_parent else None,
            )

    def is_running(self) -> bool:
        """True while the main process has not exited."""
        return self.process is not None and self.process.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last `n` lines of the log."""
        return log_tail(self.log_path, n)

    def wait_http(
        self,
        url: str,
        timeout_s: float,
        *,
        status: int = 200,
        progress_grace_s: float | None = None,
        progress_logs: Sequence[Path] = (),
        timeout_hint: str = "a slow machine may need a larger timeout",
        request_timeout_s: float = 5.0,
        failed: Callable[[httpx.Client], str | None] | None = None,
    ) -> float:
        """Block until GET `url` answers `status`; returns the seconds waited.

        With `progress_grace_s`, the wait goes on past `timeout_s` for as long as the log (and
        `progress_logs`) keeps growing (a first start that downloads a model or compiles kernels
        prints progress) and ends once they have been silent for `progress_grace_s`.

        `failed` is asked on every poll whether the process reported that it cannot become
        ready (e.g. a sidecar's fatal error in `/status`); a message ends the wait at once.

        Raises:
            ProcessExitedError: the process exited first (the message has its exit code).
            StartTimeoutError: the time ran out; the message has `timeout_hint`.
            ProcessStartError: `failed` returned a message.
            All messages end with the last lines of the log.
        """
        if self.process is None:
            raise RuntimeError(f"wait_http() called before start() of {self.name}")
        logs = [self.log_path, *progress_logs]
        started = time.monotonic()
        next_report = started + PROGRESS_EVERY_S
        size, last_growth = _total_size(logs), started
        with httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=min(2.0, request_timeout_s))) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ProcessExitedError(
                        f"{self.name} exited with code {code} before {url} answered (log {self.log_path});"
                        f" last log lines:\n{self.log_tail()}"
                    )
                try:
                    if client.get(url).status_code == status:
                        waited = time.monotonic() - started
                        logger.info("%s answered at %s after %.0f s", self.name, url, waited)
                        return waited
                    why = failed(client) if failed is not None else None
                except httpx.HTTPError:
                    why = None
                if why:
                    raise ProcessStartError(
                        f"{self.name} cannot become ready: {why} (log {self.log_path});"
                        f" last log lines:\n{self.log_tail()}"
                    )
                now = time.monotonic()
                current = _total_size(logs)
                if current != size:
                    size, last_growth = current, now
                if now - started > timeout_s:
                    if progress_grace_s is None or now - last_growth >= progress_grace_s:
                        silent = (
                            f" and its log {self.log_path} showed no progress for {now - last_growth:.0f} s"
                            if progress_grace_s is not None
                            else ""
                        )
                        raise StartTimeoutError(
                            f"{url} did not answer within {timeout_s:.0f} s{silent} ({self.name}, process"
                            f" {self.pid} still running; log {self.log_path}); {timeout_hint}."
                            f" Last log lines:\n{self.log_tail()}"
                        )
                    if now >= next_report:
                        logger.info(
                            "%s at %s is still starting after %.0f s (past the %.0f s timeout) and its"
                            " log shows progress; waiting",
                            self.name,
                            url,
                            now - started,
                            timeout_s,
                        )
                        next_report = now + PROGRESS_EVERY_S
                elif now >= next_report:
                    logger.info("waiting for %s at %s (%.0f s elapsed)", self.name, url, now - started)
                    next_report = now + PROGRESS_EVERY_S
                time.sleep(POLL_S)

    def stop(self, timeout_s: float = 20.0, sig: int = signal.SIGTERM, reap_timeout_s: float = 10.0) -> None:
        """Stop the whole group: `sig` (SIGTERM), then SIGKILL after `timeout_s`.

        Process groups that descendants started of their own (seen before the signal) are
        killed too once the main process is gone, and their zombies that were re-parented to this
        process (PID 1, a subreaper) are reaped (`reap_orphans`). Safe to call more than once, and
        also when the main process already died (its children are still killed through the group).
        Returns after at most about `timeout_s` + 2 x `reap_timeout_s`: a process that even SIGKILL
        does not end (uninterruptible sleep: a hung GPU driver or network file system) is logged
        and left behind.
        """
        if self.process is None:
            return
        pgid = self.process.pid
        others = descendant_groups(pgid)
        groups = {pgid, *others}
        reap_orphans(groups, exclude=pgid)
        if group_alive(pgid):
            logger.info("stopping %s (process group %d)", self.name, pgid)
            signal_group(pgid, sig)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self.process.poll()
                reap_orphans(groups, exclude=pgid)
                if not group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                logger.warning(
                    "%s (process group %d) ignored %s for %.0f s; sending SIGKILL",
                    self.name,
                    pgid,
                    signal.Signals(sig).name,
                    timeout_s,
                )
                signal_group(pgid, signal.SIGKILL)
        try:
            self.process.wait(timeout=reap_timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
            try:
                self.process.wait(timeout=reap_timeout_s)
            except subprocess.TimeoutExpired:
                logger.error(
                    "%s (pid %d) did not end %.0f s after SIGKILL (uninterruptible sleep: a hung driver"
                    " or file system?); leaving it behind",
                    self.name,
                    pgid,
                    reap_timeout_s,
                )
                return
        deadline = time.monotonic() + reap_timeout_s
        for group in (pgid, *others):
            while group_alive(group) and time.monotonic() < deadline:
                signal_group(group, signal.SIGKILL)
                reap_orphans(groups, exclude=pgid)
                time.sleep(0.1)
        reap_orphans(groups, exclude=pgid)
        # Zombies their parent (init, usually) reaps in a moment: give it that moment, so the group
        # is gone when this returns; not longer (a parent that never reaps them would hold stop()).
        settle = time.monotonic() + ZOMBIE_SETTLE_S
        for group in (pgid, *others):
            while _group_listed(group) and time.monotonic() < settle:
                reap_orphans(groups, exclude=pgid)
                time.sleep(0.05)
