"""Hosts for ``hvdliterun``: ``-H`` and hostfiles, the ssh check at start, the interface.

Importing this module has no side effects.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shlex
import socket
import struct
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hvdlite._rankside.protocol import worker_table

__all__ = ["Host", "check_host", "check_ssh", "choose_interface", "forwarded_env",
           "interface_address", "interface_for", "is_local", "parse_hostfile", "parse_hosts",
           "ssh_for_mpi", "ssh_options", "transport", "worker_table"]

SSH_CONNECT_TIMEOUT_S = 7  # a host that does not answer ssh in this long is unreachable
SSH_CHECK_TIMEOUT_S = 9.5  # the whole check, all hosts at once (the promise: under 10 s)
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Host:
    """A host of the job and how many ranks (slots) it runs."""

    name: str
    slots: int


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_host(name: str, where: str) -> str:
    """``name`` if it is a host name (RFC 1123: labels of letters, digits and inner ``-``,
    253 characters at most) or an IP address; ValueError naming ``where`` otherwise. A host
    reaches ssh and the MPI launcher's command lines: one that starts with ``-`` would be an
    option there."""
    if not name:
        raise ValueError(f"{where}: empty host name")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return name
    labels = (name[:-1] if name.endswith(".") else name).split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{where}: {name!r} is not a host name or an IP address (RFC 1123: "
                         "letters, digits, '-' and '.', no part starting or ending with '-')")
    return name


def _host(name: str, slots_text: str, where: str) -> Host:
    check_host(name, where)
    try:
        slots = int(slots_text)
    except ValueError:
        raise ValueError(f"{where}: slots of host {name!r} must be an integer, got "
                         f"{slots_text!r}") from None
    if slots < 1:
        raise ValueError(f"{where}: host {name!r} needs at least 1 slot, got {slots}")
    return Host(name, slots)


def parse_hosts(text: str) -> list[Host]:
    """``"a:2,b:2"`` (a host without ``:N`` has 1 slot) -> hosts, in order."""
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        hosts.append(_host(name.strip(), slots or "1", f"-H {text!r}"))
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """A hostfile: one host a line, ``host slots=N`` (Horovod, Open MPI) or ``host:N``
    (MPICH) or ``host`` (1 slot); ``#`` starts a comment."""
    hosts = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"hostfile {path}, line {number}"
            words = line.split()
            name, _, slots = words[0].partition(":")
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key == "slots":
                    slots = value
                elif key not in ("max_slots", "max-slots"):
                    raise ValueError(f"{where}: unknown field {word!r} (expected slots=N)")
            hosts.append(_host(name, slots or "1", where))
    if not hosts:
        raise ValueError(f"hostfile {path}: no hosts in it")
    return hosts


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    names.add(socket.gethostname().split(".")[0])
    return names


def is_local(host: str) -> bool:
    """True if ``host`` names this machine (by name, or an address of one of its interfaces)."""
    if host in _local_names():
        return True
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(host)
        if address.startswith("127."):
            return True
        return address in {interface_address(name) for _, name in socket.if_nameindex()}
    return False


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_for(host: str) -> tuple[str, str]:
    """The interface (name, address) this machine reaches ``host`` through, by the routing
    table (a UDP connect sends nothing). OSError if it cannot be resolved or routed."""
    address = socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        local = sock.getsockname()[0]
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name, local
    raise OSError(f"no interface has the address {local} that routes to {host} ({address})")


def ssh_options(port: int | None, identity: str | None) -> list[str]:
    """ssh's options for ``--ssh-port`` / ``--ssh-identity-file`` (Horovod's flags)."""
    if identity is not None and not os.path.isfile(identity):
        raise ValueError(f"--ssh-identity-file {identity}: no such file")
    if identity is not None and any(c.isspace() for c in identity):
        raise ValueError(f"--ssh-identity-file {identity!r}: a path without spaces, please "
                         "(the MPI launchers split their ssh arguments on spaces)")
    return ((["-p", str(port)] if port is not None else [])
            + (["-i", os.path.abspath(identity)] if identity is not None else []))


def ssh_for_mpi(flavor: str, ssh_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """MPI launcher arguments and its own environment that give its ssh ``ssh_args``."""
    if not ssh_args:
        return [], {}
    if flavor == "openmpi":
        return ["--mca", "plm_rsh_args", " ".join(ssh_args)], {}
    return [], {"HYDRA_LAUNCHER_EXTRA_ARGS": " ".join(ssh_args)}


def choose_interface(named: str | None, remote: list[str]) -> tuple[str | None, str]:
    """(interface, its address): the one named (``--network-interface``; the first of a
    list), else the one this host routes to the first remote host by; with neither, no
    interface and the loopback address. OSError when it cannot be found."""
    if named:
        first = named.split(",")[0]
        address = interface_address(first)
        if address is None:
            raise OSError(f"interface {first!r} has no IPv4 address on this host")
        return named, address
    if remote:
        return interface_for(remote[0])
    return None, "127.0.0.1"


def _ssh_one(host: str, python: str, ssh_args: list[str], out: dict[str, str]) -> None:
    remote = f"test -x {shlex.quote(python)} || {{ echo 'no {python} there'; exit 3; }}"
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
           *ssh_args, "--", host, remote]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=SSH_CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        out[host] = f"ssh did not answer in {SSH_CHECK_TIMEOUT_S:g} s"
        return
    except OSError as exc:
        out[host] = f"cannot run ssh: {exc}"
        return
    if proc.returncode == 3:
        out[host] = (f"{python} does not exist there (install the same Python environment at "
                     "the same path on every host, e.g. on a shared file system)")
    elif proc.returncode != 0:
        text = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
        out[host] = f"ssh failed: {text}"


def check_ssh(hosts: list[str], python: str, ssh_args: Sequence[str] = ()) -> dict[str, str]:
    """Reach every host over ssh (all at once) and check that ``python`` exists there.

    Returns ``{host: what went wrong}`` for the hosts that failed; empty when all are fine.
    Blocks at most ``SSH_CHECK_TIMEOUT_S`` (plus thread start-up)."""
    problems: dict[str, str] = {}
    threads = [threading.Thread(target=_ssh_one, args=(h, python, list(ssh_args), problems),
                                daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SSH_CHECK_TIMEOUT_S + 1)
    return {h: problems[h] for h in hosts if h in problems}


# Always forwarded to the ranks (Open MPI forwards nothing by itself; Hydra everything).
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
FORWARD_PREFIXES = ("HVDLITE_", "HOROVOD_")
# Never forwarded: the launcher sets its own, per job or per rank.
PRIVATE_NAMES = frozenset({"HVDLITE_CONFIG", "HVDLITE_RUN_REPORT_DIR", "HVDLITE_WATCHDOG_FD",
                           "HVDLITE_MONITOR_ADDR", "HVDLITE_MONITOR_TOKEN",
                           "HVDLITE_MONITOR_BEAT_S", "HVDLITE_MONITOR_TIMEOUT_S",
                           "HVDLITE_WORKERS", "HVDLITE_OUTPUT_DIR", "HVDLITE_ELASTIC_DIR",
                           "HVDLITE_ELASTIC_GENERATION", "HVDLITE_RANK_PATH"}
                          | {f"{prefix}_{name}" for prefix in ("HOROVOD", "HVDLITE")
                             for name in ("HOSTNAME", "RANK", "SIZE", "LOCAL_RANK",
                                          "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")})


def forwarded_env(environ: dict[str, str], named: list[str]) -> dict[str, str]:
    """The variables every rank gets from here: ``FORWARD_NAMES``, every ``HVDLITE_*`` and
    ``HOROVOD_*``, and ``named`` (``NAME`` from ``environ`` or ``NAME=VALUE``). ``PATH`` is
    passed as it is: ``python3`` on a rank is what ``command -v python3`` finds here.
    ValueError for a named variable that is not set here."""
    out = {k: v for k, v in environ.items()
           if (k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)) and k not in PRIVATE_NAMES}
    for item in named:
        name, eq, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_"):
            raise ValueError(f"-x/--env {item!r}: expected NAME or NAME=VALUE")
        if eq:
            out[name] = value
        elif name in environ:
            out[name] = environ[name]
        else:
            raise ValueError(f"-x/--env {name}: not set in this environment; give a value "
                             f"with -x {name}=VALUE")
    return out


def transport(flavor: str, iface: str | None, tcp: bool) -> tuple[list[str], dict[str, str]]:
    """Launcher arguments and rank variables for the interface(s) (``eth0`` or, as Horovod's
    flag, ``eth0,eth1``: Open MPI takes the list, Hydra and libfabric the first) and the
    TCP-only choice."""
    args: list[str] = []
    env: dict[str, str] = {}
    if flavor == "openmpi":
        if iface:
            args += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface]
        if tcp:
            args += ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"]
        return args, env
    if iface:
        first = iface.split(",")[0]  # Horovod takes a list; Hydra and libfabric take one
        args += ["-iface", first]  # Hydra: the proxies dial the launcher on this interface
        env["FI_TCP_IFACE"] = first  # libfabric's tcp provider
    if tcp:
        env |= {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    return args, env
