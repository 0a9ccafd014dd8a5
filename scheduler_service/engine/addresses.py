"""Where the replicas are: a comma list of engine addresses, or `dns:///name:port` (a Kubernetes
headless Service) resolved to one replica per address."""

from __future__ import annotations

import asyncio
import socket

DNS_PREFIX = "dns:///"


def is_replicated(engine_address: str) -> bool:
    """Whether engine_address names several replicas (a list or a DNS name to resolve)."""
    return "," in engine_address or engine_address.startswith(DNS_PREFIX)


def split_addresses(engine_address: str) -> list[str]:
    return [part.strip() for part in engine_address.split(",") if part.strip()]


async def resolve_dns(target: str) -> list[str]:
    """`dns:///name:port` -> sorted "ip:port" of every address the name has (a headless Service
    has one per ready pod). An unresolvable name gives [] (pods may not exist yet)."""
    host, _, port = target[len(DNS_PREFIX) :].rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )
    except socket.gaierror:
        return []
    return sorted(
        {
            f"[{info[4][0]}]:{port}" if ":" in str(info[4][0]) else f"{info[4][0]}:{port}"
            for info in infos
        }
    )
