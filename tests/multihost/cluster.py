"""Real hosts on one machine, for the multi-host tests: namespaces, addresses, sshd.

Each host is a network namespace with its own address (a veth pair to a bridge that lives in
a namespace of its own, so the machine's own network is never touched), and a process tree in
its own UTS (hostname), mount (its own ``/dev/shm``, ``/tmp``, ``/etc/hosts`` and
``/root/.ssh``), IPC, PID and time namespaces. An sshd runs inside each, with host and user
keys made here; ``hvdliterun -H`` reaches the hosts through ssh like real nodes. The file
system is shared, as a cluster's NFS home is (the Python environment and the checkout), except
for the per-host mounts above; ``shared`` (a directory of the test's) is visible on every host
at the same path.

Built and torn down by the tests, as root; :func:`unavailable` says in one line why not where
it cannot be. A host can be killed (SIGKILL to its PID namespace's init: every process in it
dies), cut off (its link on the bridge down), reconnected and revived.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "10.213.7"  # inside the test's namespaces only
START_TIMEOUT_S = 20.0
ALT_SSH_PORT = 2200

# The init (PID 1) of a host's PID namespace: mounts, hostname, then sshd; reaps orphans.
_INIT = r"""
import os, signal, socket, subprocess, sys, time
name, address, hosts_file, ssh_dir, sshd_config, ready, log = sys.argv[1:8]
keep = sys.argv[8:]  # directories every host sees (the shared one, the checkout, the venv)
def sh(*args):
    subprocess.run(args, check=True)
socket.sethostname(name)
sh("mount", "--make-rprivate", "/")
sh("mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", "/dev/shm")
sh("mount", "--bind", hosts_file, "/etc/hosts")
sh("mount", "--bind", ssh_dir, "/root/.ssh")
os.makedirs("/mnt", exist_ok=True)
sh("mount", "-t", "tmpfs", "tmpfs", "/mnt")  # staging: keep those under /tmp visible
for i, path in enumerate(keep):
    os.mkdir(f"/mnt/{i}")
    sh("mount", "--bind", path, f"/mnt/{i}")
sh("mount", "-t", "tmpfs", "tmpfs", "/tmp")  # the host's own /tmp
for i, path in enumerate(keep):
    os.makedirs(path, exist_ok=True)
    sh("mount", "--move", f"/mnt/{i}", path)
os.makedirs("/run/sshd", exist_ok=True)
with open(log, "ab") as out:
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", sshd_config],
                            stdout=out, stderr=out)
def stop(signum, frame):
    os.kill(-1, signal.SIGKILL)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
end = time.monotonic() + 15
while time.monotonic() < end:
    try:
        socket.create_connection((address, 22), timeout=0.5).close()
        break
    except OSError:
        time.sleep(0.05)
open(ready, "w").close()
while True:
    try:
        pid, _ = os.wait()
    except ChildProcessError:
        time.sleep(0.2)
        continue
    if pid == sshd.pid:
        stop(0, None)
"""

_NEEDED = ("ip", "unshare", "nsenter", "ssh", "ssh-keygen")


def unavailable() -> str | None:
    """Why hosts cannot be built here (one line), or None."""
    if sys.platform != "linux":
        return "multi-host tests need Linux namespaces"
    if os.geteuid() != 0:
        return "multi-host tests build network namespaces and need root"
    missing = [tool for tool in _NEEDED if shutil.which(tool) is None]
    if not os.access("/usr/sbin/sshd", os.X_OK):
        missing.append("sshd (Debian: openssh-server)")
    if missing:
        return f"multi-host tests need {', '.join(missing)} (apt-get install iproute2 " \
               "openssh-server openssh-client util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return ("multi-host tests cannot create namespaces here (a container without "
                f"CAP_SYS_ADMIN?): {probe.stderr.strip() or probe.returncode}")
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


@dataclass
class Host:
    name: str
    address: str
    netns: str
    port: str  # its veth end on the bridge, in the switch namespace
    clock_offset_s: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    init_pid: int = 0  # the PID namespace's init, as this machine sees it


@dataclass
class Cluster:
    """``n`` hosts named ``<tag>n1``..; :meth:`start`, then :meth:`run` commands on them."""

    base: Path
    shared: Path
    n: int = 2
    clock_offsets_s: tuple[int, ...] = ()
    tag: str = field(default_factory=lambda: "hv" + secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)

    @property
    def alt_key(self) -> Path:
        """The key that only port ALT_SSH_PORT accepts (and that port only it)."""
        return self.base / "keys" / "alt_ed25519"

    @property
    def ghost(self) -> str:
        """A host name every host resolves to an address on the bridge that nobody has."""
        return f"{self.tag}ghost"

    @property
    def ghost_address(self) -> str:
        return f"{SUBNET}.99"

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    # -- building --------------------------------------------------------------------------
    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.shared.mkdir(parents=True, exist_ok=True)
        for i in range(1, self.n + 1):
            offsets = self.clock_offsets_s
            self.hosts.append(Host(f"{self.tag}n{i}", f"{SUBNET}.{i}", f"{self.tag}n{i}",
                                   f"v{i}", offsets[i - 1] if i <= len(offsets) else 0,
                                   self.base / f"n{i}"))
        try:
            self._network()
            self._keys()
            for host in self.hosts:
                self._boot(host)
            for host in self.hosts:
                self._await_ready(host)
        except BaseException:
            self.stop()
            raise

    def _network(self) -> None:
        _run("ip", "netns", "add", self.switch)
        sw = ("ip", "-n", self.switch)
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "link", "set", "br0", "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.netns)
            _run(*sw, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns",
                 h.netns)
            _run(*sw, "link", "set", h.port, "master", "br0", "up")
            ns = ("ip", "-n", h.netns)
            _run(*ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _run(*ns, "link", "set", "eth0", "up")
            _run(*ns, "link", "set", "lo", "up")

    def _keys(self) -> None:
        keys = self.base / "keys"
        shutil.rmtree(keys, ignore_errors=True)  # made anew for every cluster
        keys.mkdir()
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdlite-test",
             "-f", str(keys / "id_ed25519"))
        (self.base / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
        # A second key, accepted only on port ALT_SSH_PORT (and there only it): for hvdliterun's
        # --ssh-port and --ssh-identity-file.
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdlite-test-alt",
             "-f", str(keys / "alt_ed25519"))
        (self.base / "alt_authorized_keys").write_text((keys / "alt_ed25519.pub").read_text())
        hosts_lines = ["127.0.0.1 localhost"]
        known = []
        for h in self.hosts:
            shutil.rmtree(h.dir, ignore_errors=True)
            h.dir.mkdir(parents=True)
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(h.dir / "host_key"))
            pub = " ".join((h.dir / "host_key.pub").read_text().split()[:2])
            known.append(f"{h.name},{h.address} {pub}")
            hosts_lines.append(f"{h.address} {h.name}")
        hosts_lines.append(f"{self.ghost_address} {self.ghost}")  # named, never answers
        (self.base / "hosts").write_text("\n".join(hosts_lines) + "\n")
        for h in self.hosts:
            ssh = h.dir / "ssh"
            ssh.mkdir(mode=0o700, exist_ok=True)
            for name in ("id_ed25519", "id_ed25519.pub"):
                shutil.copy2(keys / name, ssh / name)
            (ssh / "known_hosts").write_text("\n".join(known) + "\n")
            (ssh / "config").write_text(
                "Host *\n  IdentityFile /root/.ssh/id_ed25519\n"
                "  UserKnownHostsFile /root/.ssh/known_hosts\n  StrictHostKeyChecking yes\n"
                "  BatchMode yes\n  LogLevel ERROR\n")
            (h.dir / "sshd_config").write_text(
                f"Port 22\nListenAddress {h.address}\nHostKey {h.dir / 'host_key'}\n"
                f"AuthorizedKeysFile {self.base / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n"
                "PrintMotd no\nMaxStartups 100\nMaxSessions 100\n"
                f"Port {ALT_SSH_PORT}\nMatch LocalPort {ALT_SSH_PORT}\n"
                f"  AuthorizedKeysFile {self.base / 'alt_authorized_keys'}\n")
        Path("/root/.ssh").mkdir(mode=0o700, exist_ok=True)  # the mount point

    def _boot(self, h: Host) -> None:
        ready = h.dir / "ready"
        ready.unlink(missing_ok=True)
        time_ns = ["--time", "--monotonic", str(h.clock_offset_s)] if h.clock_offset_s else []
        h.proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--fork", "--kill-child", "--pid",
             "--mount-proc", "--uts", "--ipc", *time_ns, "--",
             sys.executable, "-I", "-c", _INIT, h.name, h.address, str(self.base / "hosts"),
             str(h.dir / "ssh"), str(h.dir / "sshd_config"), str(ready),
             str(h.dir / "sshd.log"), *self._kept()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(h.dir / "init.log", "ab"))  # noqa: SIM115 - the host's life long

    def _kept(self) -> list[str]:
        """The shared directory, and the checkout and Python environment where they are
        under /tmp (a real cluster shares them over NFS or installs them on every host)."""
        repo = Path(__file__).resolve().parents[2]
        kept = [self.shared, repo, Path(sys.prefix).resolve()]
        under_tmp = [p for p in kept[1:] if Path("/tmp") in p.parents]
        return [str(p) for p in [self.shared, *under_tmp]
                if p == self.shared or not any(q in p.parents for q in kept if q != p)]

    def _await_ready(self, h: Host) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while not (h.dir / "ready").exists():
            if h.proc is not None and h.proc.poll() is not None:
                log = (h.dir / "init.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"host {h.name} did not start: {log}")
            if time.monotonic() > end:
                raise RuntimeError(f"host {h.name}: sshd not up in {START_TIMEOUT_S} s")
            time.sleep(0.05)
        assert h.proc is not None
        children = Path(f"/proc/{h.proc.pid}/task/{h.proc.pid}/children").read_text().split()
        h.init_pid = int(children[0])

    # -- using -----------------------------------------------------------------------------
    def host(self, i: int) -> Host:
        return self.hosts[i - 1]

    def command(self, i: int, args: list[str], cwd: str | None = None) -> list[str]:
        """``args`` run on host ``i`` (in all its namespaces)."""
        h = self.host(i)
        return ["nsenter", "-t", str(h.init_pid), "-a", f"--wd={cwd or os.getcwd()}", "--",
                *args]

    def run(self, i: int, args: list[str], timeout: float, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(i, args, cwd), capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)

    def popen(self, i: int, args: list[str], env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(i, args, cwd), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def kill(self, i: int) -> None:
        """Every process of host ``i`` SIGKILLed at once (its PID namespace ends)."""
        h = self.host(i)
        os.kill(h.init_pid, signal.SIGKILL)
        if h.proc is not None:
            h.proc.wait(timeout=10)

    def cut(self, i: int) -> None:
        """Host ``i``'s link down (on the bridge's side: no carrier, packets go nowhere)."""
        _run("ip", "-n", self.switch, "link", "set", self.host(i).port, "down")

    def reconnect(self, i: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.host(i).port, "up")

    def revive(self, i: int) -> None:
        """Start host ``i`` again (after :meth:`kill`), with a fresh process tree."""
        h = self.host(i)
        if h.proc is not None and h.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.init_pid, signal.SIGKILL)
            h.proc.wait(timeout=10)
        self._boot(h)
        self._await_ready(h)

    def stop(self) -> None:
        for h in self.hosts:
            if h.proc is not None and h.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if h.init_pid:
                        os.kill(h.init_pid, signal.SIGKILL)
                    h.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.proc.wait(timeout=10)
        for name in [h.netns for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@contextlib.contextmanager
def running_cluster(base: Path, **kwargs: Any) -> Iterator[Cluster]:
    """A started :class:`Cluster` under ``base`` for the block, stopped after it; the test is
    skipped, with the reason, where hosts cannot be built or inside an MPI job (the
    multi-host tests start their own jobs)."""
    import pytest
    from jobs_util import under_mpi_launcher

    why = unavailable()
    if why is None and under_mpi_launcher():
        why = "multi-host tests start their own jobs; not inside an MPI job"
    if why is not None:
        pytest.skip(why)
    hosts = Cluster(base=base / "_hosts", shared=base, **kwargs)
    hosts.start()
    try:
        yield hosts
    finally:
        hosts.stop()
