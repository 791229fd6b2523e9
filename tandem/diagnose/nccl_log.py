"""`tandem doctor --nccl-log FILE`: summarise an NCCL_DEBUG=INFO log and flag known bad signs.

Reads the lines NCCL prints at communicator init (versions 2.x, old and new channel
formats):

    NCCL version 2.21.5+cuda12.4
    host:pid:tid [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.0.1<0>
    host:pid:tid [0] NCCL INFO Using network IB
    host:pid:tid [0] NCCL INFO Channel 00/08 :    0   1   2   3            (a ring)
    host:pid:tid [0] NCCL INFO Trees [0] 1/-1/-1->0->-1 [1] ...            (trees)
    host:pid:tid [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0/GDRDMA
    host:pid:tid [0] NCCL INFO 8 coll channels, 0 nvls channels, 8 p2p channels, ...
    host:pid:tid [0] NCCL INFO comm 0x... rank 0 nranks 16 ... - Init COMPLETE
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.errors import DataError
from tandem.diagnose.checks import FAIL, INFO, PASS, WARN, Check

_PREFIX = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\](?: \S+:\d+)? NCCL (?P<level>INFO|WARN)")
_VERSION = re.compile(r"NCCL version (\S+)")
_NETWORK = re.compile(r"Using network (\S+)")
_IB_USING = re.compile(r"NET/IB : Using (.*?)(?: ; OOB|$)")
_IB_DEV = re.compile(r"\[\d+\]([\w.-]+):(\d+)")
_CONN = re.compile(r"Channel (\d+)(?:/\d+)? : (\d+)\[[^\]]*\] -> (\d+)\[[^\]]*\](?: \[(send|receive)\])? via (\S+)")
_RING = re.compile(r"Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*$")
_TREES = re.compile(r"\bTrees\b(.*)$")
_CHANNELS = re.compile(r"(\d+) coll channels")
_ENVSET = re.compile(r"(NCCL_\w+) set by environment to ([^\s.]+)")
_NRANKS = re.compile(r"rank (\d+) nranks (\d+)")


def transport_class(via: str) -> str:
    """'NET/IB/0/GDRDMA' -> 'NET/IB', 'P2P/IPC/read' -> 'P2P', 'SHM/direct/direct' -> 'SHM'."""
    parts = via.split("/")
    return "/".join(parts[:2]) if parts[0] in ("NET", "COLLNET") else parts[0]


@dataclass
class NcclLogSummary:
    version: str = ""
    hosts: list[str] = field(default_factory=list)
    network: str = ""                                     # "IB" | "Socket" | plugin name
    ib_devices: list[str] = field(default_factory=list)   # device:port NCCL found
    ib_absent: bool = False                                # "NET/IB : No device found"
    peers: dict[tuple[int, int], str] = field(default_factory=dict)   # (src, dst) -> transport class
    transports: Counter = field(default_factory=Counter)                # class -> connections
    rings: int = 0
    trees: int = 0
    channels: int = 0
    nranks: int = 0
    init_complete: int = 0
    env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    nccl_lines: int = 0


def parse(text: str) -> NcclLogSummary:
    s = NcclLogSummary()
    hosts: dict[str, None] = {}
    ring_ids: set[int] = set()
    for line in text.splitlines():
        m = _PREFIX.match(line)
        if m:
            s.nccl_lines += 1
            hosts[m.group("host")] = None
            if m.group("level") == "WARN":
                s.warnings.append(line[m.end():].strip())
        if (v := _VERSION.search(line)) and not s.version:
            s.version = v.group(1)
            s.nccl_lines += 0 if m else 1
        if not m:
            continue
        body = line[m.end():]
        if n := _NETWORK.search(body):
            s.network = n.group(1)
        if ib := _IB_USING.search(body):
            for dev, port in _IB_DEV.findall(ib.group(1)):
                if f"{dev}:{port}" not in s.ib_devices:
                    s.ib_devices.append(f"{dev}:{port}")
        if "NET/IB : No device found" in body:
            s.ib_absent = True
        if c := _CONN.search(body):
            src, dst, via = int(c.group(2)), int(c.group(3)), c.group(5)
            cls = transport_class(via)
            s.peers[(src, dst)] = cls
            s.transports[cls] += 1
        elif r := _RING.search(body):
            ring_ids.add(int(r.group(1)))
        if t := _TREES.search(body):
            s.trees = max(s.trees, len(re.findall(r"\[\d+\]", t.group(1))))
        if ch := _CHANNELS.search(body):
            s.channels = max(s.channels, int(ch.group(1)))
        if e := _ENVSET.search(body):
            s.env[e.group(1)] = e.group(2)
        if i := _NRANKS.search(body):
            s.nranks = max(s.nranks, int(i.group(2)))
            s.init_complete += "Init COMPLETE" in body
    s.hosts = list(hosts)
    s.rings = len(ring_ids)
    s.channels = s.channels or s.rings
    return s


def read(path: Path) -> NcclLogSummary:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise DataError(f"cannot read the NCCL log ({e.strerror})", field="--nccl-log", value=str(path),
                        fix="give the path of a file written with NCCL_DEBUG=INFO (NCCL_DEBUG_FILE=...)") from None
    s = parse(text)
    if not s.nccl_lines:
        raise DataError("no NCCL lines in this file", field="--nccl-log", value=str(path),
                        fix="run the job with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET is enough) "
                            "and pass that output")
    return s


def judge(s: NcclLogSummary, local_ib_devices: list[str] | None = None) -> list[Check]:
    """Known bad signs, each a warn/fail with its fix; the summary lines are info."""
    out = [Check("nccl version", INFO if s.version else WARN, s.version or "not in the log",
                 fix="" if s.version else "the log misses NCCL's first lines; capture from process start")]
    per_peer = ", ".join(f"{k} x{v}" for k, v in sorted(s.transports.items())) or "none logged"
    out.append(Check("transports", INFO, f"{per_peer} over {len(s.peers)} peer connections; "
                                         f"network {s.network or '?'}; hosts {len(s.hosts)}"))
    out.append(Check("topology", INFO, f"{s.rings} rings, {s.trees} trees, {s.channels} channels, "
                                       f"{s.nranks or '?'} ranks"))
    ib_exists = bool(s.ib_devices) or bool(local_ib_devices)
    socket_used = s.transports.get("NET/Socket", 0) > 0 or s.network == "Socket"
    if socket_used and ib_exists:
        where = ", ".join(s.ib_devices or local_ib_devices or [])
        out.append(Check("socket despite InfiniBand", FAIL,
                         f"inter-node traffic goes over TCP sockets although RDMA devices exist ({where})",
                         fix="unset NCCL_IB_DISABLE / NCCL_NET=Socket, make NCCL_IB_HCA name the devices "
                             "(ibv_devinfo), and check the RDMA libraries are in the container"))
    elif socket_used:
        out.append(Check("socket transport", WARN, "inter-node traffic uses TCP sockets (no RDMA devices found)",
                         fix="fine for Ethernet-only clusters; with InfiniBand/RoCE, expose /dev/infiniband "
                             "to the container and install rdma-core"))
    elif s.transports.get("NET/IB"):
        out.append(Check("inter-node transport", PASS, "NET/IB (RDMA) between nodes"))
    for var, val in sorted(s.env.items()):
        if var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE") and val == "1":
            out.append(Check(var, WARN, "set to 1 in the environment",
                             fix=f"unset {var} unless it works around a known hardware problem: it forces "
                                 "a slower transport"))
    if 0 < s.channels < 2 and s.nranks > 1:
        out.append(Check("channels", WARN, f"only {s.channels} channel",
                         fix="one channel uses one SM/link: check NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS "
                             "and that GPUs see each other (nvidia-smi topo -m)"))
    if s.init_complete == 0:
        out.append(Check("init", WARN, "no 'Init COMPLETE' line: the communicator never finished initialising",
                         fix="the job hung or crashed in init: look at the WARN lines and the first rank that stopped"))
    else:
        out.append(Check("init", PASS, f"{s.init_complete} rank(s) reached Init COMPLETE"))
    if s.warnings:
        first = s.warnings[0][:160]
        out.append(Check("nccl warnings", WARN, f"{len(s.warnings)} WARN line(s); first: {first}",
                         fix="read the WARN lines: they name the failing call (often a network or shm error)"))
    return out
