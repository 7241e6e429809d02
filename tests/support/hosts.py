"""Hosts made of Linux namespaces on one machine: each its own network stack (a veth into one
bridge, an address in 198.18.0.0/24, no route out), UTS, IPC and mount namespace (a private
/tmp, /dev/shm and home), netem or a rate cap on its link; all torn down on exit, failure or
signal.

Usable from tests (`namespace_hosts`) and from scripts. Needs root and iproute2 (`ip`, `tc`)
and util-linux (`unshare`, `nsenter`); `skip_reason()` says what is missing.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from tests.support.waiting import wait_for

SUBNET_PREFIX = "198.18.0."  # RFC 2544 benchmark range: nothing real lives there
GATEWAY = SUBNET_PREFIX + "1"  # the test process's own address on the bridge
FIRST_HOST = 10
IFNAME = "eth0"  # every host's interface, as on a machine with one NIC
_counter = itertools.count()
_live: list[HostNetwork] = []


def skip_reason() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-host tests make network namespaces: run as root"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}` (apt-get install -y iproute2 util-linux)"
    probe = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    taken = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    if f"inet {GATEWAY}/" in taken.stdout:
        return f"{GATEWAY} is already in use here (another host network is up)"
    return None


def netem_missing() -> str | None:
    """Why `tc netem` (delay, loss) cannot run here, or None: some kernels lack sch_netem."""
    probe = f"pdnetem{os.getpid()}"
    _sh("ip", "netns", "add", probe)  # a veth of its own, gone with the namespace
    try:
        _sh("ip", "-n", probe, "link", "add", "qa", "type", "veth", "peer", "name", "qb")
        done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "qa",
                               "root", "netem", "delay", "1ms"], capture_output=True, text=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if done.returncode != 0:
        return f"this kernel has no netem qdisc (sch_netem): {done.stderr.strip()}"
    return None


def _shared_under_tmp() -> list[Path]:
    """The repository and the interpreter's environment where they live under /tmp: every
    host sees them at the same path, as machines of one image do."""
    repo = Path(__file__).resolve().parents[2]
    paths = {repo, Path(sys.prefix).resolve()}
    under = [p for p in paths if p.is_relative_to("/tmp")]
    return sorted(p for p in under if not any(p != q and p.is_relative_to(q) for q in under))


def _tmp_mirror(host_tmp: Path, path: Path) -> Path:
    """Where ``path`` (under /tmp) appears in a host's own /tmp dir, made empty for a bind."""
    mirror = host_tmp / path.relative_to("/tmp")
    mirror.mkdir(parents=True, exist_ok=True)
    return mirror


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Host:
    """One host: its namespaces are held by ``init_pid`` (a `sleep`), entered by `popen`."""

    name: str
    address: str
    netns: str
    veth: str  # the bridge-side end of its link, in the root namespace
    root: Path  # holds its private /tmp, /dev/shm and home

    @property
    def home(self) -> Path:
        """Its private home directory as this process sees it (on the host: $HOME)."""
        return self.root / "home"
    init_pid: int = 0
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--target={self.init_pid}", "--net", "--mount", "--uts", "--ipc",
                "--"]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              log: Path | None = None, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host (its own session; output to ``log`` if given)."""
        out = log.open("ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen([*self.nsenter(), *argv], env=dict(env or os.environ),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, **kwargs)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.started.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = 120.0, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end; RuntimeError with its output if it fails."""
        done = subprocess.run([*self.nsenter(), *argv], env=dict(env or os.environ),
                              capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} on {self.name} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done

    def pids(self) -> list[int]:
        """Every process in this host's network namespace but its init."""
        try:
            mine = os.readlink(f"/proc/{self.init_pid}/ns/net")
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.init_pid:
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/ns/net") == mine:
                        found.append(int(entry))
        return found

    def kill_all(self, sig: int = signal.SIGKILL, timeout_s: float = 15.0) -> None:
        """Send ``sig`` to every process of this host (its init stays) and wait them gone:
        a machine that lost power, with ``SIGKILL``."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.01)  # reap our direct children
        wait_for(lambda: not [p for p in self.pids() if not _zombie(p)], timeout_s,
                 f"every process of {self.name} to exit", interval_s=0.1)
        self.started.clear()

    def set_link(self, up: bool) -> None:
        """Bring this host's link (the bridge side of its veth) up or down: a cable pulled."""
        _sh("ip", "link", "set", self.veth, "up" if up else "down")

    def set_netem(self, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay (and lose) packets each way on this host's link (`netem`; kernels without it
        raise: `netem_missing` says so first); no argument clears it."""
        self._set_qdisc(["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
                        if delay_ms or loss_pct else None)

    def set_rate(self, kbit: int | None) -> None:
        """Cap this host's link at ``kbit`` kbit/s each way (`tbf`); None clears it."""
        self._set_qdisc(None if kbit is None else
                        ["tbf", "rate", f"{kbit}kbit", "burst", "16kb", "latency", "10s"])

    def _set_qdisc(self, qdisc: list[str] | None) -> None:
        for prefix, dev in (([], self.veth), (self.nsenter(), IFNAME)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if qdisc is not None:
                _sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *qdisc)

    def link_bytes(self) -> tuple[int, int]:
        """Bytes (received, sent) by this host over its link, read at the bridge side."""
        stats = Path("/sys/class/net") / self.veth / "statistics"
        # The bridge side's tx is what the host received, and the other way round.
        return (int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text()))


def _home_entry_of(path: Path) -> Path | None:
    """The entry of this user's home that holds ``path``, if it lies under the home."""
    home = Path.home()
    if home in path.parents:
        return home / path.relative_to(home).parts[0]
    return None


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class HostNetwork:
    """N hosts on one bridge. `close` (also at exit and on SIGTERM/SIGHUP) kills every process
    in them, deletes namespaces, veths and the bridge, and removes their private dirs."""

    def __init__(self, num_hosts: int, hostname: str | None = None) -> None:
        tag = f"{os.getpid()}{next(_counter):x}"
        self.bridge = f"pdb{tag}"[:15]
        self.root = Path(tempfile.mkdtemp(prefix="pdhosts-", dir="/var/tmp"))
        self.shared = self.root / "shared"  # visible at this path on every host
        self.shared.mkdir()
        self.hosts = [Host(f"h{i}", f"{SUBNET_PREFIX}{FIRST_HOST + i}", f"pdh{tag}-{i}",
                           f"pdv{tag}{i}"[:15], self.root / f"h{i}") for i in range(num_hosts)]
        self._hostname = hostname
        self._closed = False
        _live.append(self)
        _install_cleanup()
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            self._make_host(host)

    def _make_host(self, host: Host) -> None:
        for sub in ("tmp", "shm"):
            (host.root / sub).mkdir(parents=True)
            (host.root / sub).chmod(0o1777)
        host.home.mkdir(mode=0o700)
        _sh("ip", "netns", "add", host.netns)
        peer = f"{host.veth}p"[:15] if len(host.veth) < 15 else host.veth[:-1] + "p"
        _sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _sh("ip", "link", "set", peer, "netns", host.netns)
        _sh("ip", "link", "set", host.veth, "master", self.bridge)
        _sh("ip", "link", "set", host.veth, "up")
        inside = ["ip", "netns", "exec", host.netns]
        _sh(*inside, "ip", "link", "set", peer, "name", IFNAME)
        _sh(*inside, "ip", "addr", "add", f"{host.address}/24", "dev", IFNAME)
        _sh(*inside, "ip", "link", "set", IFNAME, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        # /dev/shm stays tmpfs (Ray's object store checks it); the host gets a dir of it.
        shm = Path("/dev/shm") / f"{host.netns}"
        shm.mkdir(mode=0o1777)
        # The interpreter may live in the real home (pyenv): the host's home shows it too,
        # as a machine's image carries it.
        keep = _home_entry_of(Path(sys.executable).resolve())
        if keep is not None:
            (host.home / keep.name).mkdir()
        # Its name resolves to its address, as a machine's does (Ray falls back on it to find
        # its own address when there is no default route).
        (host.root / "hosts").write_text(
            f"127.0.0.1 localhost\n{host.address} {self._hostname or host.name}\n")
        # The code and its venv stay at their paths when they live under /tmp (a clone there):
        # bound into the host's own /tmp before it covers the machine's.
        keep_tmp = "".join(f"mount --bind {shlex.quote(str(path))} "
                           f"{shlex.quote(str(_tmp_mirror(host.root / 'tmp', path)))} && "
                           for path in _shared_under_tmp())
        script = (keep_tmp + 'mount --rbind "$1" /tmp && mount --bind "$2" /dev/shm && '
                  '{ [ -z "$6" ] || mount --bind "$6" "$3/$(basename "$6")"; } && '
                  'mount --rbind "$3" "$4" && mount --bind "$7" /etc/hosts && hostname "$5" && '
                  'echo ready && exec sleep infinity')
        init = subprocess.Popen(
            [*inside, "unshare", "--mount", "--uts", "--ipc", "--propagation", "private", "--",
             "sh", "-c", script, "sh", str(host.root / "tmp"), str(shm), str(host.home),
             str(Path.home()), self._hostname or host.name, str(keep or ""),
             str(host.root / "hosts")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True)
        host.init_pid = init.pid
        assert init.stdout is not None
        if init.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"host {host.name} did not start: {init.stderr.read()!r}")  # type: ignore[union-attr]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            if host.init_pid:
                with contextlib.suppress(AssertionError):
                    host.kill_all()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.init_pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(host.init_pid, 0)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            shutil.rmtree(Path("/dev/shm") / host.netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _close_all() -> None:
    for network in list(_live):
        network.close()


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    _close_all()
    # Then die of the signal as we would have without this handler.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_installed: list[bool] = []


def _install_cleanup() -> None:
    """Once per process: tear down at exit and on SIGTERM/SIGHUP (SIGINT raises
    KeyboardInterrupt, which unwinds through `close` like any failure)."""
    if _installed:
        return
    _installed.append(True)
    atexit.register(_close_all)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _on_signal)


@contextlib.contextmanager
def namespace_hosts(num_hosts: int, hostname: str | None = None) -> Iterator[HostNetwork]:
    """``num_hosts`` hosts h0, h1, ... at 198.18.0.10, .11, ...; ``hostname`` gives them all
    one hostname (pods of one node), else each is named after itself."""
    network = HostNetwork(num_hosts, hostname)
    try:
        yield network
    finally:
        network.close()
