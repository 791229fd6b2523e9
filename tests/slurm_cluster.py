"""A real 2-node Slurm cluster on this machine, from Debian's own packages, for the tests.

    root = slurm_root()                       # daemons.py's apt-get download + dpkg -x, cached; None + why
    with SlurmCluster(tmp_dir, root) as c:    # munged, slurmctld, slurmd -N n1 / -N n2 on 127.0.0.1
        subprocess.run(["sbatch", ...], env=c.env)

Nothing is installed system-wide: the .deb files are unpacked into a cache folder, every
daemon gets its config, socket, state and log paths in ``tmp_dir``, on free loopback ports,
runs in the foreground as our child, and is killed (process group) on exit. Run by hand:

    python tests/slurm_cluster.py /tmp/slurm-play    # brings it up, prints the env, waits for Ctrl-C
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from daemons import Daemons, fetch_debs, kill_all, marked

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurm-wlm-basic-plugins", "munge", "libmunge2",
            "libhwloc15", "liblua5.1-0"]
LIB = "usr/lib/x86_64-linux-gnu"


def cache_dir() -> Path:
    base = os.environ.get("TANDEM_CACHE_DIR_SLURM") or os.path.expanduser("~/.cache/tandem/slurm")
    return Path(base)


def slurm_root() -> tuple[Path | None, str]:
    """(folder with usr/sbin/slurmctld-wlm, "") or (None, why not). Downloads once, then reuses."""
    root = cache_dir() / "root"
    if (root / "usr/sbin/slurmctld-wlm").exists() and (root / "usr/sbin/munged").exists():
        return root, ""
    why = fetch_debs(PACKAGES, root)
    return (None, why) if why else (root, "")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


CONF = """\
ClusterName=tandemtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.sock,cred_expire=5
CredType=cred/munge
PluginDir={root}/{lib}/slurm-wlm
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
{nodes}
# Preemption by partition: a job in "high" takes the nodes of a running job in "low" (PriorityTier 1),
# which gets SIGTERM and GraceTime seconds to save before it is requeued; "debug" (the default) is
# never preempted.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=2
PartitionName=low Nodes={names} MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=120
PartitionName=high Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2
"""


class SlurmCluster(Daemons):
    """munged + slurmctld + N slurmd, all our children, in ``workdir``; ``env`` points clients at them."""

    def __init__(self, workdir: Path, root: Path, nodes: int = 2, cpus: int = 4):
        self.dir, self.root = Path(workdir), Path(root)
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        lib = self.root / LIB
        self.env = {**os.environ,
                    "SLURM_CONF": str(self.dir / "slurm.conf"),
                    "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(lib), str(lib / "slurm-wlm"),
                                                                     os.environ.get("LD_LIBRARY_PATH")])),
                    "PATH": os.pathsep.join([str(self.root / "usr/bin"), os.environ.get("PATH", "")])}
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]  # a test run inside an allocation must not leak that job's env into ours

    # -- life cycle --------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.dir / "log" / f"{name}.out", "w")
        p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def start(self, timeout: float = 30) -> None:
        d = self.dir
        for sub in ("munge", "state", "run", "log", *(f"spool/{n}" for n in self.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        sbin = self.root / "usr/sbin"
        self._spawn([str(sbin / "munged"), "-F", "-f", f"--socket={d}/munge/munge.sock", f"--key-file={key}",
                     f"--log-file={d}/log/munged.log", f"--pid-file={d}/munge/munged.pid",
                     f"--seed-file={d}/munge/munged.seed"], "munged")
        _wait(lambda: (d / "munge/munge.sock").exists(), timeout, "munged's socket", self)
        ports = free_ports(1 + len(self.names))
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={p} CPUs={self.cpus} "
                          f"State=UNKNOWN" for n, p in zip(self.names, ports[1:]))
        (d / "slurm.conf").write_text(CONF.format(ctld_port=ports[0], dir=d, root=self.root, lib=LIB, nodes=nodes,
                                                  names=",".join(self.names)))
        conf = str(d / "slurm.conf")
        self._spawn([str(sbin / "slurmctld-wlm"), "-D", "-i", "-f", conf], "slurmctld")
        for n in self.names:
            self._spawn([str(sbin / "slurmd-wlm"), "-D", "-N", n, "-f", conf, "-d", str(sbin / "slurmstepd-wlm")],
                        f"slurmd-{n}")
        _wait(lambda: self._idle_nodes() == len(self.names), timeout, "every node idle in sinfo", self)

    def _idle_nodes(self) -> int:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        return len({ln.split()[0] for ln in r.stdout.splitlines() if ln.split()[-1] == "idle"})  # once per partition

    def stop(self) -> None:
        """Kill every daemon, then every process that carries this cluster's SLURM_CONF in its environment.

        slurmstepd and the job's tasks leave the daemons' process groups (setsid), so killing the
        groups is not enough: the environment ties each of them to this cluster and to no other.
        """
        left = kill_all(self.procs, self.strays)
        if left:
            raise RuntimeError(f"processes of the test Slurm cluster survived SIGKILL: {left}")

    def strays(self) -> list[int]:
        """Live processes (not zombies) whose environment holds this cluster's SLURM_CONF."""
        return marked(f"SLURM_CONF={self.env['SLURM_CONF']}".encode())

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)


def _wait(pred, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        dead = [p for p in cluster.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a Slurm daemon exited ({dead[0].args[0]} rc {dead[0].returncode}) while waiting "
                               f"for {what}\n{cluster.logs()}")
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}\n{cluster.logs()}")


if __name__ == "__main__":
    root, why = slurm_root()
    if root is None:
        sys.exit(f"cannot bring up Slurm: {why}")
    if sys.argv[1:] == ["--fetch-only"]:
        print(f"Slurm's packages unpacked in {root}")
        sys.exit(0)
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tandem-slurm")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill PID tears down like Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even when started in the background
    with SlurmCluster(work, root) as c:
        print(f"export SLURM_CONF={c.env['SLURM_CONF']} LD_LIBRARY_PATH={c.env['LD_LIBRARY_PATH']} "
              f"PATH={c.root / 'usr/bin'}:$PATH", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
