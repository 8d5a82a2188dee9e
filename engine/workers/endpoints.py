"""Worker addresses: HOST:PORT parsing, and which binds are safe without asking."""

from __future__ import annotations

import ipaddress
import socket

from engine.errors import InvalidSettingError

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default

# Printed whenever a worker listens beyond this machine: the protocol has no
# authentication and a client can make the worker allocate memory and run graphs.
EXPOSED_WARNING = (
    "WARNING: this worker listens on {host}:{port}, beyond this machine. llama.cpp's RPC "
    "protocol has no authentication or encryption: anyone who can reach the port can use "
    "this machine's memory and compute, and read what it computes. Prefer a loopback "
    "worker reached through an SSH tunnel (on the client: ssh -N -L {port}:127.0.0.1:{port} "
    "user@this-machine, then --workers 127.0.0.1:{port}).")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port). Raises InvalidSettingError."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidSettingError("workers", "must be HOST:PORT, e.g. 127.0.0.1:50052", text)
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise InvalidSettingError("workers", "port must be between 1 and 65535", text)
    return host.strip("[]"), port


def parse_workers(text: str | None) -> tuple[str, ...]:
    """A comma-separated list of HOST:PORT, normalised; empty for None or ""."""
    if not text:
        return ()
    endpoints = []
    for part in text.split(","):
        if part.strip():
            host, port = parse_endpoint(part)
            endpoints.append(f"{host}:{port}")
    if len(set(endpoints)) != len(endpoints):
        raise InvalidSettingError("workers", "names a worker twice", text)
    return tuple(endpoints)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (localhost, 127.0.0.0/8, ::1); a name is
    resolved, and counts as loopback only if every address it has is."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addresses)


def listener_pid(endpoint: str) -> int | None:
    """The process listening at a loopback ``endpoint`` on this machine (a worker sharing
    its cores), None when it is elsewhere or cannot be seen."""
    import psutil

    host, port = parse_endpoint(endpoint)
    if not is_loopback(host):
        return None
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    return next((c.pid for c in connections if c.status == psutil.CONN_LISTEN
                 and c.laddr and c.laddr.port == port and c.pid), None)


def check_bind(host: str, allow_network: bool) -> None:
    """Refuse a bind beyond loopback unless the user asked for it explicitly."""
    if not is_loopback(host) and not allow_network:
        raise InvalidSettingError(
            "host", "is beyond this machine, and the RPC protocol has no authentication: "
            "pass --allow-network to serve it anyway, or keep 127.0.0.1 and reach the worker "
            "through an SSH tunnel", host)
