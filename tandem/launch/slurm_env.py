"""Where this process sits in a Slurm job, read from Slurm's own environment variables.

Small functions on purpose (a cluster-environment resolver can call them as they are):

    expand_hostlist("gpu-[001-003,010]")  -> ["gpu-001", "gpu-002", "gpu-003", "gpu-010"]
    slurm_env(os.environ)                 -> SlurmEnv | None (None: not inside a Slurm job)
    slurm_rendezvous(env)                 -> SlurmRendezvous(nnodes, node_rank, master_addr, master_port) | None

The node list expands exactly as ``scontrol show hostnames`` does (Slurm 22.05; the tests
compare against the real command): ranges keep their zero padding, several bracket groups
form a cartesian product (``r[1-2]n[1-2]``), duplicates and order are kept, and the forms
scontrol refuses (a reversed range, text after the last bracket such as ``x[1,3]-ib``, an
unclosed bracket) are errors rather than a guess.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping

from tandem.core.errors import LaunchError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _bad(hostlist: str, why: str) -> LaunchError:
    return LaunchError(f"invalid Slurm node list: {why}", field="SLURM_JOB_NODELIST", value=hostlist,
                       fix="give hosts as name[1-3,5] or a,b,c, as `scontrol show hostnames` accepts them")


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise _bad(hostlist, f"{part!r} is not a number or a range lo-hi")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise _bad(hostlist, f"range {part} runs backwards")
        width = len(lo_s)  # Slurm pads to the width of the lower bound (n[001-2] -> n001 n002)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(item: str, hostlist: str) -> list[str]:
    if "[" not in item:
        if "]" in item:
            raise _bad(hostlist, f"{item!r} has ']' without '['")
        return [item]
    if not item.endswith("]"):
        raise _bad(hostlist, f"{item!r} has text after its last bracket group")
    names = [""]
    rest = item
    while rest:
        i = rest.find("[")
        if i < 0:
            raise _bad(hostlist, f"{item!r} has text after its last bracket group")
        j = rest.find("]", i)
        if j < 0:
            raise _bad(hostlist, f"{item!r} has an unclosed '['")
        prefix, body, rest = rest[:i], rest[i + 1:j], rest[j + 1:]
        names = [n + prefix + r for n in names for r in _expand_ranges(body, hostlist)]
    return names


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm node list (``SLURM_JOB_NODELIST``) into host names, as ``scontrol show hostnames``."""
    if hostlist.count("[") != hostlist.count("]"):
        raise _bad(hostlist, "its brackets do not pair up")
    hosts: list[str] = []
    for item in _split_top(hostlist.strip()):
        for word in item.split():  # scontrol also splits on spaces
            hosts.extend(_expand_one(word, hostlist))
    if not hosts:
        raise _bad(hostlist, "it names no host")
    return hosts


@dataclass(frozen=True)
class SlurmEnv:
    """The fields of a Slurm job's environment that placing torchrun needs."""
    job_id: str
    nodelist: list[str]        # every node of the job, in Slurm's order (node 0 first)
    nnodes: int
    node_rank: int             # SLURM_NODEID: this node's index in the job
    in_step: bool              # inside an `srun` step (SLURM_STEP_ID set), not the batch script itself
    ntasks: int                # tasks of this step (1 per node for `srun tandem launch`)
    restart_count: int         # SLURM_RESTART_COUNT: how often the job was requeued
    submit_dir: str = ""


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    v = env.get(key, "")
    try:
        return int(v) if v != "" else default
    except ValueError:
        raise LaunchError(f"{key} is not an integer", field=key, value=v,
                          fix="unset it, or run inside a Slurm job that sets it") from None


def slurm_env(env: Mapping[str, str]) -> SlurmEnv | None:
    """Slurm's view of this process, or None outside a Slurm job (no SLURM_JOB_ID)."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_hostlist(nodelist) if nodelist else []
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", len(hosts) or 1))
    return SlurmEnv(job_id=job_id, nodelist=hosts, nnodes=nnodes, node_rank=_int(env, "SLURM_NODEID", 0),
                    in_step="SLURM_STEP_ID" in env or "SLURM_STEPID" in env,
                    ntasks=_int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1)),
                    restart_count=_int(env, "SLURM_RESTART_COUNT", 0), submit_dir=env.get("SLURM_SUBMIT_DIR", ""))


@dataclass(frozen=True)
class SlurmRendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def default_port(job_id: str) -> int:
    """A port every node of a job computes alike (used when MASTER_PORT is not exported)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits) % 20000


def node_address(host: str, resolve=socket.gethostbyname, scontrol: str = "scontrol") -> str:
    """An address for ``host``: DNS first, else the NodeAddr Slurm itself uses (``scontrol show node``).

    Node names need not resolve (cloud clusters, test clusters): Slurm reaches its nodes through
    NodeAddr, so that is the address workers can reach too.
    """
    try:
        return resolve(host)
    except OSError:
        pass
    try:
        r = subprocess.run([scontrol, "show", "node", host, "-o"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"node {host} does not resolve and scontrol could not be run ({e})",
                          field="SLURM_JOB_NODELIST", value=host,
                          fix="export MASTER_ADDR=<address of the job's first node> before `srun tandem launch`") \
            from None
    m = re.search(r"\bNodeAddr=(\S+)", r.stdout)
    if r.returncode != 0 or not m:
        raise LaunchError(f"node {host} does not resolve and `scontrol show node {host}` gives no NodeAddr",
                          field="SLURM_JOB_NODELIST", value=host,
                          fix="export MASTER_ADDR=<address of the job's first node> before `srun tandem launch`")
    return m.group(1)


def slurm_rendezvous(env: Mapping[str, str], address=node_address) -> SlurmRendezvous | None:
    """torchrun's static rendezvous for one `tandem launch` per node of this Slurm step, or None.

    None outside a step (the batch script itself, or an salloc shell: there is no agent on the
    other nodes to meet) and when the step runs more than one task per node (each task would
    start a whole node's workers). MASTER_ADDR / MASTER_PORT, when exported, win.
    """
    s = slurm_env(env)
    if s is None or not s.in_step or s.ntasks != s.nnodes:
        return None
    addr = env.get("MASTER_ADDR") or (address(s.nodelist[0]) if s.nodelist else "127.0.0.1")
    port = _int(env, "MASTER_PORT", default_port(s.job_id))
    return SlurmRendezvous(nnodes=s.nnodes, node_rank=s.node_rank, master_addr=addr, master_port=port)


def _main(argv: list[str]) -> int:
    """`python -m tandem.launch.slurm_env master-addr | free-port`: for the generated batch script."""
    if argv == ["master-addr"]:
        s = slurm_env(os.environ)
        if s is None or not s.nodelist:
            print("error: SLURM_JOB_NODELIST: not inside a Slurm job", file=sys.stderr)
            return 2
        try:
            print(node_address(s.nodelist[0]))
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if argv == ["free-port"]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            print(sock.getsockname()[1])
        return 0
    print("usage: python -m tandem.launch.slurm_env master-addr | free-port", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
