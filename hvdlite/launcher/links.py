"""Which links carry a job's data: this process's TCP connections, as the kernel lists them.

The doctor (``hvdliterun -H ... --check``) records, on every rank after its self-test, the
interfaces of its host (:func:`addresses`), the MPI transport asked for (:func:`mpi_transport`)
and the established TCP connections this very process holds (:func:`tcp_peers`: the sockets
among ``/proc/self/fd`` matched with ``/proc/net/tcp``). :func:`describe_links` then says, per
pair of hosts, whether the ranks' data went over TCP and on which interfaces and addresses, and
per host whether its ranks talk without TCP (shared memory). Linux only; elsewhere the lists are
empty. Importing this module has no side effects.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

__all__ = ["addresses", "describe_links", "mpi_transport", "tcp_peers"]

_ESTABLISHED = "01"


def addresses() -> dict[str, str]:
    """``{interface: IPv4 address}`` of this host, loopback left out."""
    from hvdlite.launcher.hosts import interface_address

    out = {}
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            address = interface_address(name)
            if address is not None and not address.startswith("127."):
                out[name] = address
    return out


def mpi_transport(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The inter-host transport the environment asks MPI for (MPICH / Open MPI variables)."""
    netmod = environ.get("MPIR_CVAR_CH4_NETMOD")
    if netmod:
        provider = environ.get("FI_PROVIDER")
        iface = environ.get("FI_TCP_IFACE")
        text = f"MPICH ch4 netmod {netmod}" + (f", libfabric provider {provider}"
                                                if provider else "")
        return text + (f" on {iface}" if iface else "")
    btl = environ.get("OMPI_MCA_btl")
    if btl:
        return f"Open MPI btl {btl}"
    return "the MPI library's default (MPICH: its first netmod, e.g. UCX; Open MPI: auto)"


def _ipv4(hex_address: str) -> str | None:
    host = hex_address.split(":")[0]
    if len(host) == 8:
        return socket.inet_ntoa(bytes.fromhex(host)[::-1])
    if len(host) == 32 and host[:24].upper() == "0000000000000000FFFF0000":  # v4-mapped
        return socket.inet_ntoa(bytes.fromhex(host[24:])[::-1])
    return None


def tcp_peers() -> list[tuple[str, str]]:
    """(local, remote) IPv4 addresses of each established TCP connection of this process."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    peers = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as handle:
            for line in handle.readlines()[1:]:
                cols = line.split()
                if len(cols) < 10 or cols[3] != _ESTABLISHED or cols[9] not in inodes:
                    continue
                local, remote = _ipv4(cols[1]), _ipv4(cols[2])
                if local and remote and not remote.startswith("127."):
                    peers.append((local, remote))
    return sorted(peers)


def describe_links(reports: Sequence[dict[str, Any]]) -> list[str]:
    """Lines naming, per pair of hosts, the TCP connections between their ranks (interface and
    addresses), and per host whether its ranks used TCP among themselves. ``reports``: one per
    rank with ``host``, ``addresses`` ({iface: ip}) and ``peers`` ([(local, remote)])."""
    host_of: dict[str, str] = {}
    iface_of: dict[str, str] = {}
    ranks: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        ranks.setdefault(r["host"], []).append(i)
        for iface, ip in r["addresses"].items():
            host_of[ip], iface_of[ip] = r["host"], iface
    pairs: dict[tuple[str, str], dict[tuple[str, str], int]] = {}
    for r in reports:
        for local, remote in r["peers"]:
            far = host_of.get(remote)
            if far is None:
                continue
            near: str = r["host"]
            key = (near, far) if near <= far else (far, near)
            ends = (local, remote) if near <= far else (remote, local)
            counts = pairs.setdefault(key, {})
            counts[ends] = counts.get(ends, 0) + 1
    hosts = list(ranks)
    lines = []
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            seen = pairs.get((min(a, b), max(a, b)))
            if not seen:
                lines.append(f"{a} <-> {b}: NO TCP connection between their ranks seen (another "
                             "transport, e.g. UCX or InfiniBand verbs, or they did not talk)")
                continue
            over = ", ".join(f"{iface_of.get(x, '?')} {x} <-> {iface_of.get(y, '?')} {y}"
                             for x, y in sorted(seen))
            lines.append(f"{min(a, b)} <-> {max(a, b)}: TCP, {sum(seen.values()) // 2} "
                         f"connection(s) over {over}")
    for host in hosts:
        inside = pairs.get((host, host))
        how = (f"TCP ({sum(inside.values()) // 2} connection(s))" if inside else
               "no TCP between them (shared memory)")
        if len(ranks[host]) > 1:
            lines.append(f"within {host} (ranks {', '.join(map(str, ranks[host]))}): {how}")
    return lines
