"""TCP ports for the rendezvous and the metrics endpoint."""

from __future__ import annotations

import socket

from duoka.errors import DuokaError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
            return True
        except OSError:
            return False


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise DuokaError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT", "write e.g. --rdzv-endpoint node0:29500")
    return host, int(port)
