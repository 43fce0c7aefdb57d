"""Checking the server addresses settings give: URLs (``--sglang-url``, ``sglang_urls``,
``sidecar_urls``) and the hosts a server binds to (``--host``, ``--sglang-host``), and whether
a server could listen there now (:func:`bindable_port`), or the sockets it will serve on, held from
the check on (:func:`listening_sockets`), before minutes of start-up are spent.

A prefix check alone let through addresses that fail later, far from the setting that named
them: ``http://::1:30000`` (an IPv6 host needs brackets), a port past 65535, a URL with a
password in it (which ``/status`` would then show to anyone). :func:`check_http_url` parses the
address once, at start-up, and says what is wrong with it.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket

import httpx

_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9_-]{0,62}))*$")


_USERINFO_RE = re.compile(r"(?P<scheme>^[^/@]*//)[^/@]*@")
"""The ``user:password@`` of a URL (whatever its scheme)."""


def _without_userinfo(text: str) -> str:
    """``text`` with a URL's ``user:password@`` shown as ``***@``."""
    return _USERINFO_RE.sub(r"\g<scheme>***@", text)


def _shown(text: str) -> str:
    """``text`` as an error may repeat it: no ``user:password@``, and nothing from a ``?`` or
    ``#`` on (a query may hold a key), shown as ``?...``."""
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=len(text))
    return _without_userinfo(text[:cut]) + ("?..." if cut < len(text) else "")


def check_http_url(url: str, name: str) -> str:
    """``url`` without its trailing ``/``, if it is an ``http(s)://host[:port][/path]`` address;
    else a ``ValueError`` naming the setting ``name`` and what to write instead."""
    url = str(url).strip().rstrip("/")
    shown = _shown(url)  # an error message never repeats a password or a query
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ValueError(f"{name} must start with http:// or https://, got {shown!r}")
    url = f"{scheme.lower()}://{rest}"
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(
            f"{name} is not a valid URL ({_shown(str(exc))}): {shown!r}; write"
            " http://HOST:PORT, an IPv6 host in brackets (http://[::1]:30000)"
        ) from None
    if not parsed.host:
        raise ValueError(f"{name} names no host: {shown!r}; write http://HOST:PORT")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{name} has port {port}, outside 1-65535: {shown!r}")
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        raise ValueError(
            f"{name} has a query or fragment (a '?' or '#' part, not repeated here: it may hold a key):"
            " give the server's base address only, http://HOST:PORT[/PATH]; pass credentials as an API"
            " key or token setting"
        )
    if parsed.userinfo:
        raise ValueError(
            f"{name} carries a user name or password ({parsed.host}); it would show in logs and /status:"
            " pass credentials as an API key or token setting instead"
        )
    return url


def check_bind_host(host: str, flag: str) -> None:
    """Raise ValueError unless ``host`` (the setting ``flag``) is an IP address or a host name
    a server can bind to."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not _HOSTNAME_RE.match(host) or host.replace(".", "").isdigit():
        raise ValueError(
            f"{flag} {host!r} is neither an IP address nor a host name: use e.g. 127.0.0.1 (this machine"
            " only) or 0.0.0.0 (every interface)"
        )


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


LISTEN_BACKLOG = 2048
"""Connections the kernel queues for a held listener (uvicorn's own default backlog)."""


def _listen(host: str, port: int) -> list[socket.socket]:
    """`listening_sockets` without its messages: the ``OSError`` of the bind that failed."""
    held: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        unique = list(dict.fromkeys((family, kind, address[:2]) for family, kind, _, _, address in infos))
        for family, kind, address in unique[:1] if port == 0 else unique:
            sock = socket.socket(family, kind)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
            if family == socket.AF_INET6:  # as asyncio's servers (uvicorn) bind: IPv4 listeners are no conflict
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL or len(unique) == 1:
                    raise
                held.pop().close()  # as asyncio: an address family this machine has not enabled
                continue
            sock.listen(LISTEN_BACKLOG)
        if not held:
            raise OSError(errno.EADDRNOTAVAIL, "no address of this machine")
        return held
    except BaseException:
        for sock in held:
            sock.close()
        raise


def listening_sockets(host: str, port: int, what: str) -> list[socket.socket]:
    """Sockets listening on ``port`` at every address ``host`` resolves to, bound the way asyncio's
    servers (uvicorn) bind them; port 0: one the OS picks, on the first address only.

    A server that is handed these (``uvicorn.Server.run(sockets=...)``) owns its port from this
    check on: nothing started meanwhile can take it. ``serve`` checked a free sidecar port and bound
    it only after SGLang's start-up, and SGLang's own ports (picked by the OS during that start-up)
    once took it. Until the server runs, a client's connection waits in the kernel's queue. The
    sockets are not inherited by child processes (SGLang). A ``ValueError`` naming ``what`` (the
    settings that gave them) when nothing can listen there: a name that does not resolve, another
    machine's address, a port in use."""
    try:
        return _listen(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"{what}: port {port} on {host} is in use by another process; pick another port") from None
        raise ValueError(
            f"{what}: nothing can listen on {host!r} ({exc.strerror or exc}); give an address of this machine,"
            " e.g. 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or ::1"
        ) from None


def bindable_port(host: str, port: int, what: str) -> int:
    """Listen on ``host:port`` (port 0: one the OS picks) the way a server does, let it go, and
    return the port; a ``ValueError`` as :func:`listening_sockets` when nothing can listen there.
    A server started later may find the port taken meanwhile: hold :func:`listening_sockets` instead."""
    sockets = listening_sockets(host, port, what)
    try:
        return int(sockets[0].getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on ``host:port`` now because another socket holds the port
    (``EADDRINUSE``, as :func:`listening_sockets` binds: TIME_WAIT is no conflict). Any other
    failure (an address not of this machine) is not this function's to report: False."""
    try:
        sockets = _listen(host, port)
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    for sock in sockets:
        sock.close()
    return False
