"""Start-up problems a person can act on: a port another process holds, named by its flag.

Every port the scheduler process opens (public gRPC, the OpenAI HTTP API, /metrics; and, for
`planserve serve`, the model service's) is tried before any is bound, so a taken port ends the
start with one line and exit status 2 (the CLIs print StartupError that way) and leaves nothing
running, instead of a traceback from whichever server library got there first.
"""

from __future__ import annotations

import socket


class StartupError(Exception):
    """One line for the person starting the process; the CLI prints it and exits with 2."""


def check_port_free(flag: str, host: str, port: int) -> None:
    """StartupError naming `flag` when `port` on `host` cannot be bound now. Port 0 (any free
    one), a negative port (not served) and a unix: address need no check."""
    if port <= 0 or host.startswith("unix:"):
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as the servers set it: a port in TIME_WAIT is free, a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise StartupError(
                f"{flag} {port}: cannot listen on {host}:{port} ({error.strerror or error}); "
                "stop what holds it or choose another port (0 picks a free one)"
            ) from None


def reserve_shared_port(flag: str, host: str, port: int) -> socket.socket:
    """A socket bound (never listening) to `port` with SO_REUSEPORT: it resolves port 0 to one
    number and holds it while the frontend processes bind theirs (--frontend-processes: they
    share the port; connections only go to the listening ones). StartupError names `flag`."""
    check_port_free(flag, host, port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host, port))
    except OSError as error:
        holder.close()
        raise StartupError(
            f"{flag} {port}: cannot listen on {host}:{port} ({error.strerror or error})"
        ) from None
    return holder
