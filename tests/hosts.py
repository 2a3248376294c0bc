"""A test bed of hosts on one machine: Linux network namespaces, each with its own address, host
name, /etc/hosts and loopback, joined by a switch (a bridge that lives in a namespace of its own, so
the machine's own interfaces and addresses are never touched). Needs root.

    with Bed(2, decoy=True) as bed:          # node0, node1 (10.R.0.10, .11); every run named ct-<id>-*
        p = bed.popen("node1", ["python", "-m", "trainer", "torchrun", ...])
        bed.cut("node1"); bed.mend("node1")  # the cable pulled at the switch, and put back
        bed.crash("node1")                   # kill -9 of every process of that host, as a node crash
    # every process of every host killed, every namespace (and so every interface) deleted

A process started on a host runs as ``nsenter --net=NS unshare --uts --mount``: its host name is the
host's, and /etc/hosts is the bed's (each name resolves to its address, as DNS or a Service does),
bind-mounted in that process's own mount namespace. ``ip netns exec`` is not used: it remounts /sys
and hides /sys/fs/cgroup, which slurmd reads. The file system is otherwise shared, as a cluster's
shared volume is.

Teardown always runs: on leaving the ``with``, on interpreter exit and for leftovers of a bed whose
test process was killed (``sweep()``, called by every new bed, deletes namespaces whose owner pid is
gone). ``python tests/hosts.py --sweep`` does it by hand; ``--check`` exits 1 if anything is left.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "ct-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _delete(ns: str) -> None:
    for _ in range(50):  # a killed process leaves the namespace when the kernel has reaped it
        pids = ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces of beds whose test process is gone (ct-<pid>-...)."""
    gone = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete(ns)
            gone.append(ns)
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):  # the beds' host files
        owner = d.name[len(PREFIX) :].split("-", 1)[0]
        if d.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
    return gone


class Bed:
    """N hosts named node0..node{N-1} on one switch; ``decoy=True`` gives every host an interface
    listed before the real one by ``hostname -I`` (as docker0 or IPoIB are on real nodes), with an
    address no other host can reach."""

    def __init__(self, n: int, decoy: bool = False, names: list[str] | None = None):
        self.names = names or [f"node{i}" for i in range(n)]
        self.decoy = decoy
        self.tag = f"{PREFIX}{os.getpid()}-{random.randrange(16**4):04x}"
        net = random.randrange(16, 250)
        self.addr = {name: f"10.{net}.0.{10 + i}" for i, name in enumerate(self.names)}
        self.decoy_addr = {name: f"192.168.{net}.{10 + i}" for i, name in enumerate(self.names)}
        self.switch = f"{self.tag}-sw"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.procs: list[subprocess.Popen] = []

    # ---------------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def port(self, host: str) -> str:
        """The host's cable's end at the switch."""
        return f"p{self.names.index(host)}"

    def __enter__(self) -> Bed:
        sweep()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addr.items())
        (self.dir / "hosts").write_text(hosts)
        for host in self.names:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.decoy:  # made first, so its address comes first; its peer leads nowhere
                _ip("-n", ns, "link", "add", "docker0", "type", "veth", "peer", "name", "docker0-peer")
                _ip("-n", ns, "addr", "add", f"{self.decoy_addr[host]}/24", "dev", "docker0")
                _ip("-n", ns, "link", "set", "docker0", "up")
                _ip("-n", ns, "link", "set", "docker0-peer", "up")
            # the cable: eth0 on the host, its other end plugged into the switch
            _ip("-n", self.switch, "link", "add", self.port(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", self.port(host), "master", "br0")
            _ip("-n", self.switch, "link", "set", self.port(host), "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for ns in [*(self.ns(h) for h in self.names), self.switch]:
            if ns in namespaces():
                _delete(ns)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)

    # ---------------------------------------------------------------------------------------------
    def wrap(self, host: str, cmd: list[str]) -> list[str]:
        """``cmd`` as a process of ``host``: its network, host name and /etc/hosts."""
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.ns(host)}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            script,
            host,
            str(self.dir / "hosts"),
            *cmd,
        ]

    def popen(self, host: str, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.wrap(host, cmd), **kw)
        self.procs.append(p)
        return p

    def run(self, host: str, cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(host, cmd), capture_output=True, text=True, timeout=timeout, **kw)

    def pids(self, host: str) -> list[int]:
        return ns_pids(self.ns(host))

    def crash(self, host: str) -> int:
        """kill -9 of every process on ``host`` at once (a node that loses power); returns how many."""
        pids = self.pids(host)
        for pid in pids:  # stop them all first, so none reacts to another's death
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def cut(self, host: str) -> None:
        """Unplug the host's cable at the switch: its packets go nowhere, its sockets stay open."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")

    def mend(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port(host), "up")

    def leftovers(self) -> list[str]:
        """Namespaces and files of this bed still there (empty after close)."""
        return [ns for ns in namespaces() if ns.startswith(self.tag)] + ([str(self.dir)] if self.dir.exists() else [])


class SlurmCluster:
    """A real Slurm cluster on a bed: slurmctld on host ``ctl``, one ``slurmd -N <host>`` on each
    other host (NodeAddr its address; spool, pid and log files per node), the machine's munged
    reused. Client commands run on a host of the bed with this cluster's SLURM_CONF. Jobs of the
    default partition ``bed`` are preempted (SIGTERM, 60 s of grace, requeued) by jobs of ``urgent``."""

    def __init__(self, bed: Bed, cpus: int, mem_mb: int = 1000, slurmd_timeout_s: int = 10):
        self.bed, self.nodes = bed, [h for h in bed.names if h != "ctl"]
        self.dir = bed.dir / "slurm"
        self.dir.mkdir()
        self.conf = self.dir / "slurm.conf"
        nodes = "".join(
            f"NodeName={h} NodeAddr={bed.addr[h]} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN\n" for h in self.nodes
        )
        d = self.dir
        self.conf.write_text(f"""ClusterName=bed
SlurmctldHost=ctl({bed.addr["ctl"]})
Include {Path(__file__).resolve().parent / "slurm" / "common.conf"}
SlurmdTimeout={slurmd_timeout_s}
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        bed.popen(
            "ctl",
            ["slurmctld", "-D", "-f", str(self.conf)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for h in self.nodes:
            self.start_node(h)
        self.wait_idle(self.nodes)

    def start_node(self, host: str) -> None:
        self.bed.popen(
            host,
            ["slurmd", "-D", "-N", host, "-f", str(self.conf)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def run(self, *cmd: str, timeout: float = 60, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, sbatch, scontrol ...), from the first node."""
        return self.bed.run(self.nodes[0], list(cmd), timeout=timeout, env={**self.env, **(env or {})}, **kw)

    def job_field(self, job: str, name: str) -> str:
        m = re.search(rf"\b{name}=(\S+)", self.run("scontrol", "show", "job", job).stdout)
        return m.group(1) if m else ""

    def states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, hosts: list[str], timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.states()
            if all(states.get(h, "").rstrip("*") in ("idle", "mix", "alloc") for h in hosts):
                return
            time.sleep(0.5)
        logs = "".join((self.dir / f).read_text()[-1500:] for f in ("slurmctld.log",) if (self.dir / f).exists())
        raise RuntimeError(f"the bed's Slurm nodes did not come up: {self.states()}\n{logs}")


def left_behind() -> list[str]:
    """Every bed's namespaces and folders, and processes that ran on a bed's host: a training or
    torchrun process in this machine's process namespace but another network namespace (a
    container's processes have a process namespace of their own), or a Slurm daemon of a bed (they
    run with -D; the one-node cluster's do not). Called when no bed should be up."""
    left = [ns for ns in namespaces() if ns.startswith(PREFIX)] + [
        str(d) for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*")
    ]
    net, pid_ns = os.readlink("/proc/self/ns/net"), os.readlink("/proc/self/ns/pid")
    for pattern in ("trainer (train|torchrun)", "slurm(ctld|d) -D"):
        for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split():
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == pid_ns and (
                    os.readlink(f"/proc/{pid}/ns/net") != net or "slurm" in pattern
                ):
                    left.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
            except OSError:  # gone meanwhile
                continue
    return left


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        print("\n".join(sweep()) or "nothing left behind")
    if "--check" in sys.argv:
        left = left_behind()
        print("\n".join(left) or "no test-bed namespace, folder or process left")
        sys.exit(1 if left else 0)
