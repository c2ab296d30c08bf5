"""Ports for a process this one starts and that binds them later (a `tokenmill serve` under Ray Serve, a test's
or a benchmark's server).

A port the kernel picks for bind(0) lies in the ephemeral range, which every outgoing connection draws its local
port from too: in the seconds a server takes to load its model, a connection of this machine (a health poll, a
peer's link) can take it, and the server's late bind then fails with "Address already in use" (a replica's
KV-event socket once failed so in CI). So the port is drawn at random below that range, where the kernel never
assigns one, checked to bind now, and never handed out twice by this process (replicas start side by side)."""
from __future__ import annotations

import random
import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()


def ephemeral_low() -> int:
    """The lowest port the kernel assigns to outgoing connections and bind(0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host now, below the ephemeral range, not handed out before by this process."""
    low = ephemeral_low()
    with _lock:
        while True:
            port = random.randrange(max(1024, low - 12000), low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    return [free_port(host) for _ in range(n)]
