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

import errno
import logging
import os
import shutil
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
PROGRESS_CAP_FACTOR = 3.0
"""`ProcessGroup.wait_http` waits past its timeout while the log shows progress, but never longer
than this many times the timeout in all: a process that logs forever and never answers (a hung
rendezvous that keeps printing that it waits) ends the wait too."""
PROC_SCAN_S = 2.0
"""The most time one look through ``/proc`` for the holders of a socket takes (`port_listeners`)."""


class ProcessStartError(RuntimeError):
    """A started process did not serve its endpoint: it exited first or the wait timed out."""


class ProcessExitedError(ProcessStartError):
    """The process exited before its endpoint answered."""


class StartTimeoutError(ProcessStartError, TimeoutError):
    """The endpoint did not answer in time (the process is still running)."""


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved here in the parent (None where there is none): the child between
    fork and exec must not import or ``dlopen`` (another thread of the parent may have held the
    loader's lock at the fork, which the child would then wait on forever)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def kill_me_with_parent() -> None:
    """In the child before exec: SIGKILL this process when the thread that started it dies.

    So a killed test run or supervisor never leaves a server behind (Linux only; a no-op
    elsewhere). The server's own children are in its process group and are stopped with it.
    Calls only what the parent resolved (:data:`_PRCTL`).
    """
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


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


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the process name (``[state, ppid, pgrp, ...]``,
    so the start time, stat's field 22, is ``[19]``); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields if len(fields) >= 20 and fields[2].lstrip("-").isdigit() else None


def _group_processes(pgids: set[int]) -> list[tuple[int, int, str, int, int]] | None:
    """(pid, parent pid, state, process group, start ticks) of every process in the process groups
    `pgids`, from ``/proc/<pid>/stat``; None when ``/proc`` cannot be listed."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for name in entries:
        if not name.isdigit():
            continue
        fields = _proc_stat(name)
        if fields is not None and int(fields[2]) in pgids:
            found.append((int(name), int(fields[1]), fields[0], int(fields[2]), int(fields[19])))
    return found


def _group_members(pgids: set[int]) -> list[tuple[int, int, str]] | None:
    """(pid, parent pid, state) of every process in the process groups `pgids`, from
    ``/proc/<pid>/stat``; None when ``/proc`` cannot be listed."""
    found = _group_processes(pgids)
    return None if found is None else [(pid, ppid, state) for pid, ppid, state, _group, _start in found]


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


_TCP_LISTEN = "0A"
"""A listening socket's state in ``/proc/net/tcp`` (``TCP_LISTEN``)."""


def listening_inodes(port: int) -> set[int] | None:
    """The inodes of the TCP sockets (IPv4 and IPv6) listening on ``port`` in this network
    namespace, from ``/proc/net/tcp`` and ``/proc/net/tcp6``; None when neither can be read (not
    Linux, no ``/proc``)."""
    found: set[int] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb") as f:
                lines = f.read().decode("ascii", errors="replace").splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            _address, _sep, hex_port = fields[1].rpartition(":")
            try:
                if int(hex_port, 16) == port and int(fields[9]) != 0:
                    found.add(int(fields[9]))
            except ValueError:
                continue
    return found if readable else None


def socket_inodes(pid: int) -> set[int] | None:
    """The inodes of the sockets process ``pid`` holds (its ``/proc/<pid>/fd`` links that read
    ``socket:[N]``); empty when it is gone, None when its descriptors cannot be read (another
    user's process)."""
    found: set[int] = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return found
    except OSError:
        return None
    for name in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile, or the process ended
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                found.add(int(target[8:-1]))
            except ValueError:
                continue
    return found


def port_listeners(port: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int] | None:
    """The processes (pids, ``exclude`` left out) that hold a socket listening on TCP ``port``,
    from ``/proc``; None when ``/proc`` cannot tell. The look takes at most `PROC_SCAN_S`: the
    processes not looked at by then are not listed."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    try:
        entries = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    deadline = time.monotonic() + PROC_SCAN_S
    found = []
    for name in entries:
        if time.monotonic() > deadline:
            break
        pid = int(name)
        if pid not in exclude and (socket_inodes(pid) or set()) & inodes:
            found.append(pid)
    return found


def describe_pids(pids: Sequence[int] | None) -> str:
    """``pid 123 (python3)`` for each of ``pids``; "pid not known" when there are none."""
    if not pids:
        return "pid not known"
    shown = []
    for pid in list(pids)[:4]:
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                name = f.read().decode("utf-8", errors="replace").strip()
        except OSError:
            name = ""
        shown.append(f"pid {pid}" + (f" ({name})" if name else ""))
    return ", ".join(shown) + (f" and {len(pids) - 4} more" if len(pids) > 4 else "")


LOG_ROTATE_BYTES = 64 * 1024 * 1024
"""A log past this size is moved to ``<log>.1`` when its process is (re)started (`rotate_log`)."""


def rotate_log(path: str | os.PathLike[str], max_bytes: int = LOG_ROTATE_BYTES) -> Path | None:
    """Move the log ``path`` to ``<path>.1`` (replacing an older one) when it is a regular file of
    more than ``max_bytes``; returns where it went, or None when it stays (small, missing, or not a
    regular file: a FIFO, and any link, is never moved: renaming ``/dev/stdout`` would move the
    link, not the file it names). A log that cannot be moved stays, with a warning: the process
    still starts, appending to it."""
    return _set_aside(path, max_bytes, os.replace, "a new one starts")


def trim_log(path: str | os.PathLike[str], max_bytes: int = LOG_ROTATE_BYTES) -> Path | None:
    """A log a running process appends to, past ``max_bytes``: its bytes copied to ``<path>.1``
    (replacing an older one) and the file emptied in place (the process's ``O_APPEND`` descriptor
    writes on at its new end; a few lines written between the copy and the truncation are lost).
    Returns where the bytes went, or None (small, missing, not a regular file, or a failure, logged)."""

    def copy_and_empty(source: str | os.PathLike[str], older: Path) -> None:
        shutil.copyfile(source, older)
        os.chmod(older, 0o600)
        os.truncate(source, 0)

    return _set_aside(path, max_bytes, copy_and_empty, "it goes on from empty")


def _set_aside(
    path: str | os.PathLike[str],
    max_bytes: int,
    move: Callable[[str | os.PathLike[str], Path], None],
    after: str,
) -> Path | None:
    """``move(path, <path>.1)`` when ``path`` is a regular file (no link) of more than ``max_bytes``;
    where its bytes went, or None (small, missing, not a regular file, or ``move`` failed: logged)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size <= max_bytes:
        return None
    older = Path(f"{os.fspath(path)}.1")
    try:
        move(path, older)
    except OSError as exc:
        logger.warning("could not move the log %s (%.0f MiB) to %s: %s", path, info.st_size / 2**20, older, exc)
        return None
    logger.info("moved the log %s (%.0f MiB) to %s; %s", path, info.st_size / 2**20, older, after)
    return older


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


def log_path_problem(path: str | os.PathLike[str], name: str) -> str | None:
    """Why ``path`` (the setting ``name``) cannot receive a process's output, from what is there now
    (nothing is opened or made); None when it can: a regular file, one that does not exist yet in
    a folder, or a pipe, FIFO or character device (``/dev/stdout``, a terminal, ``/dev/null``;
    whether a FIFO has a reader shows only when :func:`open_log` opens it)."""
    text = os.fspath(path)
    if not text.strip():
        return f"{name} is empty: name a file (e.g. /var/log/sglang.log), or leave it out for a temporary file"
    try:
        kind = _not_a_log(os.stat(text).st_mode)
    except FileNotFoundError:
        above = Path(os.path.abspath(text)).parent
        while not os.path.lexists(above) and above != above.parent:
            above = above.parent
        if os.path.exists(above) and not os.path.isdir(above):
            return (
                f"{name} {text}: {above} is not a directory, so no file can be made below it; name a file in a folder"
            )
        return None
    except OSError:
        return None  # unreadable here: opening it says why (open_log)
    return f"{name} {text} is {kind}: name a file (e.g. {os.path.join(text, 'sglang.log')})" if kind else None


def _not_a_log(mode: int) -> str | None:
    """What a file of ``mode`` is when nothing can be written to it as a log (else None)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device"
    return None


def open_log(path: str | os.PathLike[str], name: str) -> int:
    """A descriptor that appends to the log ``path`` (the setting ``name``), for a child's output.

    Never blocks: a plain open of a FIFO that no process reads waits for a reader forever, deaf to
    SIGTERM and Ctrl-C, so it is opened non-blocking (such a FIFO is then an error at once) and set
    blocking again for the child once open. A regular file is made when missing; a pipe or FIFO
    that something reads and a character device work too (see :func:`log_path_problem`). Raises
    ValueError naming ``name`` and what to do."""
    problem = log_path_problem(path, name)
    if problem:
        raise ValueError(problem)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Its user's alone when made here: SGLang logs its arguments at start, API key included.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO (or a socket's /proc link) with no reader
            raise ValueError(
                f"{name} {path} is a FIFO that no process reads: writing to it would wait for a reader"
                " forever; start its reader first, or name a regular file"
            ) from None
        raise ValueError(f"cannot open {name} {path} to append to it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        kind = _not_a_log(st.st_mode)
        if kind:  # replaced between the look and the open
            raise ValueError(f"{name} {path} is {kind}: name a file")
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # one made before (by an older release, by hand): SGLang logs its key
        os.set_blocking(fd, True)  # the child writes its output as to any file: waiting when a pipe is full
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        log_path: file that receives the process's stdout and stderr (appended to; see `open_log`).
        name: what error messages and log lines call the process (e.g. "SGLang server").
        env: the full environment of the process (default: this process's).
        cwd: its working directory.
        die_with_parent: SIGKILL the process when the thread that started it dies
            (`kill_me_with_parent`).
        log_name: what errors about the log call it (the setting that named it, e.g.
            ``--sglang-log``; default: "the log of NAME").

    The group's id is the leader's pid, which the system may give to a new process once the leader
    has been reaped and the group's last member is gone. So after the leader is reaped, a group is
    signalled only while a process this object remembers (by pid and start time, which
    ``/proc/<pid>/stat`` gives: a pid is reused, never with the same start time) is
    still in it: never a stranger that got the number (a `stop()` long after the first one).
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
        log_name: str | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.name = name
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        self.log_name = log_name or f"the log of {name}"
        self.process: subprocess.Popen[bytes] | None = None
        self._known: dict[int, int] = {}
        """Processes seen in this run's groups while they were provably its own: pid -> start ticks."""
        self._other_groups: set[int] = set()
        """Process groups that descendants started of their own, seen while the leader ran."""
        self.stranger: str | None = None
        """Set by `wait_http` with ``listen_port`` when another process than this run's answered
        there (``pid 123 (python3)``): it holds the port. Reset by `start()`."""

    @property
    def pid(self) -> int | None:
        """Process id of the main process (also the process-group id), or None before `start()`."""
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit code once the main process has exited, else None."""
        return self._poll() if self.process is not None else None

    def start(self) -> None:
        """Launch the process in a new session; returns at once (see `wait_http`).

        Raises ValueError (naming `log_name`) when the log cannot be opened (`open_log`)."""
        if self.is_running():
            raise RuntimeError(f"{self.name} already running with pid {self.pid}; stop() it first")
        log = open_log(self.log_path, self.log_name)
        try:
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
        finally:
            os.close(log)
        self._known, self._other_groups, self.stranger = {}, set(), None

    def is_running(self) -> bool:
        """True while the main process has not exited."""
        return self.process is not None and self._poll() is None

    def _poll(self) -> int | None:
        """The leader's exit code, None while it runs; reaps it once it has exited. The one way this
        class reaps it: first the members of its groups are remembered (`_remember`), while the
        leader's unreaped pid still holds the group's id for them."""
        assert self.process is not None
        if self.process.returncode is None:
            try:  # has it exited? asked without reaping it (WNOWAIT)
                exited = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except (AttributeError, OSError):  # no waitid here, or reaped by another waiter: poll() says
                exited = None
            else:
                if exited is None:
                    return None
                self._remember({self.process.pid, *self._other_groups})
        return self.process.poll()

    def _remember(self, groups: set[int]) -> None:
        """Remember every process now in ``groups`` (provably this run's) by pid and start time."""
        for pid, _ppid, _state, _group, started in _group_processes(groups) or ():
            self._known[pid] = started

    def _owns(self, group: int) -> bool:
        """Whether process group ``group`` is still this run's: its leader is not reaped yet (the
        group's id is then its pid, which cannot be reused), or a process remembered in it
        (`_remember`: same pid, same start time) is still a member."""
        assert self.process is not None
        if group == self.process.pid and self.process.returncode is None:
            return True
        members = _group_processes({group}) or ()
        return any(self._known.get(pid) == started for pid, _ppid, _state, _group, started in members)

    def _signal(self, group: int, sig: int) -> None:
        """`signal_group`, only to a group this run owns (`_owns`)."""
        if self._owns(group):
            signal_group(group, sig)

    def _alive(self, group: int) -> bool:
        """`group_alive` for a group this run owns; False for one it does not (a stranger's)."""
        return self._owns(group) and group_alive(group)

    def _wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the leader to exit, reaping it; whether it did. The members of
        its groups are remembered first (`_remember`), while its unreaped pid still holds the id."""
        assert self.process is not None
        if self.process.returncode is None:
            self._remember({self.process.pid, *self._other_groups})
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def member_pids(self) -> set[int] | None:
        """The live (not zombie) processes of this run's groups: the leader's, those descendants
        started of their own; None when ``/proc`` cannot be listed."""
        if self.process is None:
            return set()
        groups = {self.process.pid, *self._other_groups}
        running = self.process.returncode is None  # not reaped: its group id and descendants are its own
        if running:
            groups |= descendant_groups(self.process.pid)
        members = _group_processes(groups)
        if members is None:
            return None
        return {
            pid
            for pid, _ppid, state, _group, started in members
            if state != "Z" and (running or self._known.get(pid) == started)
        }

    def listens_on(self, port: int) -> bool | None:
        """Whether a process of this run (`member_pids`) holds a socket listening on TCP ``port``;
        None when ``/proc`` cannot tell (not Linux, ``/proc/net/tcp`` unreadable or listing no
        listener on the port, this run's descriptors unreadable)."""
        inodes = listening_inodes(port)
        if not inodes:
            return None
        pids = self.member_pids()
        if pids is None:
            return None
        unknown = False
        for pid in pids:
            held = socket_inodes(pid)
            if held is None:
                unknown = True
            elif held & inodes:
                return True
        return None if unknown else False

    def _answered_by_us(self, url: str, port: int) -> bool:
        """Whether the answer just read from ``url`` came from this run: a process of it listens on
        ``port`` (`listens_on`). When ``/proc`` cannot tell, the answer is taken (as before this
        check existed). Another process's answer sets `stranger` and is logged once."""
        ours = self.listens_on(port)
        if ours is None:
            logger.debug("cannot tell from /proc which process listens on port %d: taking the answer of %s", port, url)
            return True
        if ours:
            return True
        if self.stranger is None:
            self.stranger = describe_pids(port_listeners(port, exclude=self.member_pids() or set()))
            logger.warning(
                "%s answered, but port %d is held by another process (%s), not by %s (process group %s):"
                " not taken for %s's answer; waiting",
                url,
                port,
                self.stranger,
                self.name,
                self.pid,
                self.name,
            )
        return False

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process group, if it is still this run's (`_owns`)."""
        if self.process is not None:
            self._signal(self.process.pid, sig)

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
        listen_port: int | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> float:
        """Block until GET `url` answers `status`; returns the seconds waited.

        With `progress_grace_s`, the wait goes on past `timeout_s` for as long as the log (and
        `progress_logs`) keeps growing (a first start that downloads a model or compiles kernels
        prints progress) and ends once they have been silent for `progress_grace_s`, or at the
        latest `PROGRESS_CAP_FACTOR` (3) times `timeout_s` after it began, however much is logged.

        With `listen_port` (the port of `url`), an answer counts only when the socket listening on
        that port belongs to a process of this run (`listens_on`): another process that took the
        port (a second server started with the same port) is not taken for this one, and the wait
        goes on (`stranger` names it). Where ``/proc`` cannot tell, any answer counts.

        `failed` is asked on every poll whether the process reported that it cannot become
        ready (e.g. a sidecar's fatal error in `/status`); a message ends the wait at once.
        `stopped` is asked on every poll too: true (a signal asked the caller to stop) ends the
        wait at once, also for a process that does not exit when it is told to.

        Raises:
            ProcessExitedError: the process exited first (the message has its exit code).
            StartTimeoutError: the time ran out; the message has `timeout_hint`.
            ProcessStartError: `failed` returned a message, or `stopped` said so.
            All messages end with the last lines of the log.
        """
        if self.process is None:
            raise RuntimeError(f"wait_http() called before start() of {self.name}")
        logs = [self.log_path, *progress_logs]
        started = time.monotonic()
        cap_s = PROGRESS_CAP_FACTOR * timeout_s
        next_report = started + PROGRESS_EVERY_S
        size, last_growth = _total_size(logs), started
        with httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=min(2.0, request_timeout_s))) as client:
            while True:
                if stopped is not None and stopped():
                    raise ProcessStartError(f"the wait for {self.name} at {url} was stopped: the caller is stopping")
                code = self._poll()
                if code is not None:
                    raise ProcessExitedError(
                        f"{self.name} exited with code {code} before {url} answered (log {self.log_path});"
                        f" last log lines:\n{self.log_tail()}"
                    )
                try:
                    answered = client.get(url).status_code == status
                    if answered and (listen_port is None or self._answered_by_us(url, listen_port)):
                        waited = time.monotonic() - started
                        logger.info("%s answered at %s after %.0f s", self.name, url, waited)
                        return waited
                    why = failed(client) if failed is not None and not answered else None
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
                    capped = now - started >= cap_s
                    if progress_grace_s is None or now - last_growth >= progress_grace_s or capped:
                        if progress_grace_s is None:
                            silent = ""
                        elif now - last_growth >= progress_grace_s:
                            silent = f" and its log {self.log_path} showed no progress for {now - last_growth:.0f} s"
                        else:
                            silent = (
                                f" nor within {cap_s:.0f} s ({PROGRESS_CAP_FACTOR:.0f} times that), the most a start"
                                f" may take while its log {self.log_path} keeps growing"
                            )
                        raise StartTimeoutError(
                            f"{url} did not answer within {timeout_s:.0f} s{silent} ({self.name}, process"
                            f" {self.pid} still running; log {self.log_path}); {timeout_hint}."
                            f" Last log lines:\n{self.log_tail()}"
                        )
                    if now >= next_report:
                        logger.info(
                            "%s at %s is still starting after %.0f s (past the %.0f s timeout) and its"
                            " log shows progress; waiting (at most %.0f s in all)",
                            self.name,
                            url,
                            now - started,
                            timeout_s,
                            cap_s,
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
        also when the main process already died (its children are still killed through the group,
        while one this object remembered is in it: never a group that has since got the number).
        Returns after at most about `timeout_s` + 2 x `reap_timeout_s`: a process that even SIGKILL
        does not end (uninterruptible sleep: a hung GPU driver or network file system) is logged
        and left behind.
        """
        if self.process is None:
            return
        pgid = self.process.pid
        if self.process.returncode is None:  # not reaped: the group is ours, and so are its descendants' seen now
            self._other_groups |= descendant_groups(pgid)
            self._remember({pgid, *self._other_groups})
        others = sorted(self._other_groups)
        groups = {pgid, *others}
        reap_orphans(groups, exclude=pgid)
        if self._alive(pgid):
            logger.info("stopping %s (process group %d)", self.name, pgid)
            self._signal(pgid, sig)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self._poll()
                reap_orphans(groups, exclude=pgid)
                if not self._alive(pgid):
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
                self._signal(pgid, signal.SIGKILL)
        if not self._wait(reap_timeout_s):
            self._signal(pgid, signal.SIGKILL)
            if not self._wait(reap_timeout_s):
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
            while self._alive(group) and time.monotonic() < deadline:
                self._signal(group, signal.SIGKILL)
                reap_orphans(groups, exclude=pgid)
                time.sleep(0.1)
        reap_orphans(groups, exclude=pgid)
        # Zombies their parent (init, usually) reaps in a moment: give it that moment, so the group
        # is gone when this returns; not longer (a parent that never reaps them would hold stop()).
        settle = time.monotonic() + ZOMBIE_SETTLE_S
        for group in (pgid, *others):
            while self._owns(group) and _group_listed(group) and time.monotonic() < settle:
                reap_orphans(groups, exclude=pgid)
                time.sleep(0.05)
