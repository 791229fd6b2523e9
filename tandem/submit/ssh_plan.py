"""The plan of `tandem submit --on ssh --hostfile H`: one `tandem launch` agent per host, over OpenSSH.

    hosts = parse_hostfile(path)          # `host slots=N` lines (DeepSpeed's format); typos name their line
    job = SshJob(run_dir, command, hosts=hosts, ...)
    plan = prepare(job)                   # checks (ssh on PATH, slots, every host answering), one line each
    print(render(plan))                   # --dry-run: the ssh command of every host
    run_job(plan)                         # ssh_run.py: runs them, output prefixed `[host] `

Every host runs one node of a static multi-node job: node rank = the host's order in the
hostfile, nproc = its slots (they may differ: torchrun's agents then assign global ranks
by the cumulative sum of the nodes' sizes, in node-rank order), master = the first host's
address (what `ssh -G HOST` says it connects to). The remote side gets a login shell's
environment, not ours: only an allowlist is passed on (TANDEM_*, NCCL_*, GLOO_*,
PYTHONPATH and each `--env K`), in the command line as `env K=V ... PYTHON -m ...`, with
the interpreter's absolute path (the same path must hold tandem on every host).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.errors import ConfigError, LaunchError

ENV_PREFIXES = ("TANDEM_", "NCCL_", "GLOO_")
ENV_NAMES = ("PYTHONPATH",)
PID_TAG = "tandem-ssh-agent"  # the first line each remote shell prints: `tandem-ssh-agent <pid>`
LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)$")
HOST = re.compile(r"^(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9_.:\[\]%-]+$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Host:
    name: str        # what ssh is given: an address, a name, an alias of ~/.ssh/config, user@host
    slots: int
    line: int        # where it stands in the hostfile (for errors)


@dataclass
class SshJob:
    run_dir: Path
    command: list[str]                  # SCRIPT args... (tandem launch) or CONFIG overrides... (tandem train)
    hosts: list[Host]
    train: bool = False
    nodes: int = 0                      # 0: every host of the hostfile
    nproc_per_node: int = 0             # 0: each host's slots
    env_keys: list[str] = field(default_factory=list)   # --env K (or K=V)
    ssh_config: str = ""                # ssh -F FILE
    master_port: int = 29500
    watchdog_s: float = 0
    connect_timeout: int = 10
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)


@dataclass
class Plan:
    """What runs where: one (host, nproc, ssh argv) per node, in node-rank order."""
    job: SshJob
    nodes: list[tuple[Host, int]]
    master_addr: str
    env: dict[str, str]
    argv: list[list[str]]

    @property
    def world(self) -> int:
        return sum(n for _, n in self.nodes)


def parse_hostfile(path: Path) -> list[Host]:
    """`host slots=N` per line; `#` starts a comment; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", field="--hostfile", value=str(path),
                          fix="give a file with one `HOST slots=N` line per machine")
    hosts: list[Host] = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"--hostfile {path} line {no}"
        m = LINE.match(text)
        if not m:
            word, num = text.split()[0], re.search(r"\d+", text[len(text.split()[0]):])
            raise ConfigError(f"{text!r} is not `HOST slots=N`", field=where, value=text,
                              fix=f"write it as `{word} slots={num[0] if num else 1}`")
        host, slots = m["host"], m["slots"]
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"slots must be a whole number of at least 1 (got {slots!r})", field=where, value=text,
                              fix=f"write `{host} slots=1` (or more)")
        if host.startswith("-") or not HOST.match(host):
            raise ConfigError(f"{host!r} is not a host name or address", field=where, value=text,
                              fix="write a host name, an address, an alias from ~/.ssh/config, or user@host")
        same = next((h for h in hosts if h.name == host), None)
        if same:
            raise ConfigError(f"{host} is listed twice (first on line {same.line})", field=where, value=text,
                              fix=f"give {host} one line with all its slots (slots={same.slots + int(slots)})")
        hosts.append(Host(host, int(slots), no))
    if not hosts:
        raise ConfigError("no hosts in it", field="--hostfile", value=str(path),
                          fix="add one `HOST slots=N` line per machine")
    return hosts


def place(job: SshJob) -> list[tuple[Host, int]]:
    """(host, workers) per node. Without --nodes/--nproc-per-node every host runs its slots; with them,
    the job asks for a world size, and the slots must hold it."""
    if not job.nodes and not job.nproc_per_node:
        nodes = [(h, h.slots) for h in job.hosts]
    else:
        n = job.nodes or len(job.hosts)
        if n > len(job.hosts):
            raise ConfigError(f"{n} nodes asked for, but the hostfile lists {len(job.hosts)} host(s)",
                              field="--nodes", value=n,
                              fix=f"use --nodes {len(job.hosts)} or add hosts to the hostfile")
        nodes = [(h, job.nproc_per_node or h.slots) for h in job.hosts[:n]]
        short = next((h for h, k in nodes if k > h.slots), None)
        if short:
            ranks = sum(k for _, k in nodes)
            raise ConfigError(f"{ranks} ranks asked for, more than the slots: {short.name} has {short.slots} "
                              f"(hostfile line {short.line}), {job.nproc_per_node} wanted",
                              field="--nproc-per-node", value=job.nproc_per_node,
                              fix=f"use --nproc-per-node {min(h.slots for h, _ in nodes)}, raise that host's slots, "
                                  "or leave both flags out to run every host's slots")
    if job.train and len({k for _, k in nodes}) > 1:
        raise ConfigError("a job spec needs the same number of workers on every node (tandem train's world is "
                          "nodes x nproc_per_node)", field="--hostfile",
                          value=", ".join(f"{h.name} slots={k}" for h, k in nodes),
                          fix="give every host the same slots, or pass --nproc-per-node K")
    return nodes


def forwarded_env(job: SshJob, env: dict[str, str]) -> dict[str, str]:
    """The allowlist: TANDEM_*, NCCL_*, GLOO_*, PYTHONPATH from ``env``, then each --env K (K=V sets V)."""
    out = {k: v for k, v in sorted(env.items()) if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and ENV_KEY.match(k)}
    for item in job.env_keys:
        key, eq, value = item.partition("=")
        if not ENV_KEY.match(key):
            raise ConfigError("not an environment variable name", field="--env", value=item,
                              fix="pass a name (--env WANDB_API_KEY) or NAME=VALUE")
        if not eq and key not in env:
            raise ConfigError(f"{key} is not set here, so there is nothing to pass on", field="--env", value=key,
                              fix=f"export {key}=... before submitting, or pass --env {key}=VALUE")
        out[key] = value if eq else env[key]
    return out


def ssh_base(job: SshJob) -> list[str]:
    """BatchMode: a host that wants a password or a host-key answer fails instead of waiting on a prompt."""
    return ["ssh", "-o", "BatchMode=yes", *(["-F", job.ssh_config] if job.ssh_config else [])]


def _abs(job: SshJob, p: Path) -> Path:
    return p if p.is_absolute() else job.workdir / p


def remote_argv(job: SshJob, node: int, nproc: int, nnodes: int, master: str) -> list[str]:
    """What one host's agent runs: `tandem launch` (a script) or `tandem train` (a job spec)."""
    run_dir = str(_abs(job, job.run_dir))
    if job.train:
        return ["train", *job.command, "--launch.nproc_per_node", str(nproc), "--launch.nnodes", str(nnodes),
                "--launch.node_rank", str(node), "--launch.master_addr", master, "--launch.master_port",
                str(job.master_port), "--launch.simulate_nodes", "0", "--launch.run_dir", run_dir,
                *(["--launch.watchdog_s", str(job.watchdog_s)] if job.watchdog_s else []), "--stream"]
    return ["launch", "--cluster", "none", "--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--node-rank",
            str(node), "--master-addr", master, "--master-port", str(job.master_port), "--run-dir", run_dir,
            *(["--watchdog-s", str(job.watchdog_s)] if job.watchdog_s else []), *job.command]


def remote_command(job: SshJob, env: dict[str, str], tandem_args: list[str]) -> str:
    """One line for the remote login shell. It prints its pid (kept by exec: the agent's pid, for
    `tandem cancel`), then execs the agent, which dies with its ssh session ($PPID, see ssh_remote.py):
    sshd leaves a command without a terminal running when the connection drops."""
    q = shlex.quote
    assigns = " ".join(f"{k}={q(v)}" for k, v in env.items())
    return (f"cd {q(str(job.workdir))} && echo {PID_TAG} $$ && exec env {assigns + ' ' if assigns else ''}"
            f"{q(job.python)} -m tandem.cli.ssh_remote $PPID {' '.join(q(a) for a in tandem_args)}")


def master_address(job: SshJob, host: Host) -> str:
    """The address ssh connects to for ``host`` (`ssh -G` resolves ~/.ssh/config aliases); other hosts
    reach node 0's rendezvous store there."""
    if shutil.which("ssh"):
        r = subprocess.run([*ssh_base(job), "-G", host.name], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname" and value:
                return value.strip()
    return host.name.rsplit("@", 1)[-1]


def check(job: SshJob, *, dry_run: bool = False) -> None:
    if not job.command:
        raise ConfigError("nothing to run", field="script", fix="give a Python script or a job spec (.toml/.yaml)")
    if job.command[0] != "-m" and not _abs(job, Path(job.command[0])).is_file():
        raise ConfigError("file not found", field="script", value=job.command[0],
                          fix="give the path of a Python script or a job spec, relative to this folder")
    if job.nodes < 0 or job.nproc_per_node < 0:
        raise ConfigError("must not be negative", field="--nodes" if job.nodes < 0 else "--nproc-per-node",
                          value=min(job.nodes, job.nproc_per_node), fix="use 1 or more")
    if not 0 < job.master_port < 65536:
        raise ConfigError("not a TCP port", field="--master-port", value=job.master_port, fix="use 1024-65535")
    if job.ssh_config and not Path(job.ssh_config).is_file():
        raise ConfigError("file not found", field="--ssh-config", value=job.ssh_config, fix="give an ssh_config file")
    if not dry_run and shutil.which("ssh") is None:
        raise ConfigError("ssh is not on PATH", field="--on", value="ssh",
                          fix="install the OpenSSH client (apt-get install openssh-client) or put `ssh` on PATH")


def probe(job: SshJob, hosts: list[Host]) -> None:
    """Every host answers `ssh HOST true` without a prompt, in parallel; the first that does not is one line."""
    def one(h: Host) -> tuple[Host, subprocess.CompletedProcess]:
        argv = [*ssh_base(job), "-o", f"ConnectTimeout={job.connect_timeout}", h.name, "true"]
        try:
            return h, subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                     timeout=job.connect_timeout + 20)
        except subprocess.TimeoutExpired:
            return h, subprocess.CompletedProcess(argv, 255, "", "no answer")
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        results = list(pool.map(one, hosts))
    for h, r in results:
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise LaunchError(f"host {h.name} (line {h.line}) cannot be reached over ssh: {why}",
                              field="--hostfile", value=h.name,
                              fix=f"make `ssh -o BatchMode=yes {h.name} true` work without a prompt (a key in "
                                  "authorized_keys, the host in known_hosts, or --ssh-config), or remove the host")


def prepare(job: SshJob, env: dict[str, str], *, dry_run: bool = False) -> Plan:
    """Every check, in the order a user fixes them, then the ssh command of every node."""
    check(job, dry_run=dry_run)
    nodes = place(job)
    fwd = forwarded_env(job, env)
    if not dry_run:
        probe(job, [h for h, _ in nodes])
    master = master_address(job, nodes[0][0])
    argv = [[*ssh_base(job), h.name, remote_command(job, fwd, remote_argv(job, i, k, len(nodes), master))]
            for i, (h, k) in enumerate(nodes)]
    return Plan(job=job, nodes=nodes, master_addr=master, env=fwd, argv=argv)


def render(plan: Plan) -> str:
    """The dry run's text. Values given with --env NAME=VALUE print as NAME=*** (API keys travel this way);
    they are still in the ssh client's argv while the job runs (docs/clusters.md)."""
    secret = [i.partition("=")[0] for i in plan.job.env_keys if i.partition("=")[0] in plan.env]

    def masked(cmd: str) -> str:
        for k in secret:
            cmd = cmd.replace(f"{k}={shlex.quote(plan.env[k])}", f"{k}=***")
        return cmd
    lines = [f"# {len(plan.nodes)} node(s), world {plan.world}, master {plan.master_addr}:{plan.job.master_port}; "
             f"env passed on: {', '.join(plan.env) or 'none'}"]
    for i, ((h, k), argv) in enumerate(zip(plan.nodes, plan.argv)):
        lines.append(f"# node {i}: {h.name}, {k} worker(s)")
        lines.append(" ".join(shlex.quote(masked(a)) for a in argv))
    return "\n".join(lines) + "\n"
