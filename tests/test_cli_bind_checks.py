"""``serve`` and ``sidecar`` find out at once when a server of theirs cannot listen where it is
told to: a host name that does not resolve, another machine's address, a port in use, or
SGLang and the sidecar given one port. Before, ``serve`` started SGLang on such a host and
waited on its health for its whole start-up timeout (SGLang does not always exit when it cannot
bind), and ``free_port`` raised a bare ``gaierror``."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from rollout_service.cli import main
from rollout_service.http_urls import bindable_port
from rollout_service.sglang_launcher import SGLangServer, free_port

NOT_THIS_MACHINE = "192.0.2.1"
"""TEST-NET-1 (RFC 5737): never an address of this machine."""


@pytest.fixture
def listening():
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sglang-host", "nosuch.invalid"], r"--sglang-host/--port: nothing can listen on 'nosuch.invalid'"),
        (["--host", "nosuch.invalid"], r"--host/--sidecar-port: nothing can listen on 'nosuch.invalid'"),
        (["--sglang-host", NOT_THIS_MACHINE], rf"--sglang-host/--port: nothing can listen on '{NOT_THIS_MACHINE}'"),
        (["--host", NOT_THIS_MACHINE], rf"--host/--sidecar-port: nothing can listen on '{NOT_THIS_MACHINE}'"),
        (["--port", "8100"], r"--port and --sidecar-port are both 8100"),
        (["--port", "8123", "--sidecar-port", "8123", "--host", "0.0.0.0"], r"are both 8123"),
    ],
    ids=[
        "sglang-host-unresolvable",
        "host-unresolvable",
        "sglang-host-elsewhere",
        "host-elsewhere",
        "one-port",
        "one-port-wildcard",
    ],
)
def test_serve_refuses_a_place_its_servers_cannot_listen_before_starting_sglang(
    capsys, tmp_path: Path, flags: list[str], message: str
) -> None:
    rc, err = run(capsys, "serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "root"), *flags)
    assert rc == 2
    assert re.search(message, err), err
    assert "give an address of this machine" in err or "each need their own" in err


def test_serve_and_sidecar_refuse_a_port_in_use(capsys, tmp_path: Path, listening: int) -> None:
    root = str(tmp_path / "root")
    rc, err = run(capsys, "serve", "--model", str(tmp_path), "--checkpoint-path", root, "--port", str(listening))
    assert rc == 2 and f"--sglang-host/--port: port {listening} on 127.0.0.1 is in use" in err
    rc, err = run(
        capsys, "serve", "--model", str(tmp_path), "--checkpoint-path", root, "--sidecar-port", str(listening)
    )
    assert rc == 2 and f"--host/--sidecar-port: port {listening} on 127.0.0.1 is in use" in err
    Path(root).mkdir()  # serve refused before making it; the sidecar needs a root
    rc, err = run(
        capsys, "sidecar", "--checkpoint-path", root, "--sglang-url", "http://127.0.0.1:1", "--port", str(listening)
    )
    assert rc == 2 and f"--host/--port: port {listening} on 127.0.0.1 is in use" in err


def test_free_port_names_a_host_it_cannot_bind_and_works_for_ipv4_and_ipv6(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing can listen on 'nosuch.invalid'"):
        free_port("nosuch.invalid")
    with pytest.raises(ValueError, match="the SGLang server's host"):
        SGLangServer(tmp_path, host=NOT_THIS_MACHINE)
    for host in ("127.0.0.1", "localhost", "0.0.0.0"):
        assert 0 < free_port(host) < 65536
    if socket.has_ipv6:
        try:
            socket.getaddrinfo("::1", 0)
        except OSError:
            return
        assert SGLangServer(tmp_path, host="::1").port > 0  # an AF_INET socket could not bind ::1


def test_a_port_only_in_time_wait_counts_as_free() -> None:
    """Servers bind with SO_REUSEADDR: a port a closed connection left in TIME_WAIT is no conflict."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers that left it set
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its port stays in TIME_WAIT
        client.close()
    time.sleep(0.2)  # the closing handshake ends
    assert bindable_port("127.0.0.1", port, "--port") == port


def test_an_ipv6_wildcard_is_no_conflict_with_an_ipv4_listener_as_for_uvicorn() -> None:
    """uvicorn binds an IPv6 host IPv6-only: an IPv4 server on the same port does not stop it,
    so the check must not refuse it either, nor take ``::`` and ``0.0.0.0`` for one address."""
    from rollout_service.cli import _same_addresses

    with socket.socket() as v4:
        v4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        v4.bind(("0.0.0.0", 0))
        v4.listen()
        port = v4.getsockname()[1]
        assert bindable_port("::", port, "--host/--port") == port
        with pytest.raises(ValueError, match="is in use"):
            bindable_port("0.0.0.0", port, "--host/--port")
    assert not _same_addresses("::", "0.0.0.0") and not _same_addresses("::1", "127.0.0.1")
    assert _same_addresses("::", "::1") and _same_addresses("0.0.0.0", "127.0.0.1") and _same_addresses("a", "a")
