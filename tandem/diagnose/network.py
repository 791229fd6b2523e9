"""Network checks: interfaces, RDMA devices, the NCCL/Gloo interface variables, the master.

Everything reads /sys/class (a parameter, so tests can hand in a small tree) and
the environment; nothing needs root.
"""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from tandem.diagnose.checks import FAIL, INFO, PASS, WARN, Check

SYS = Path("/sys/class")


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:  # speed of a down or virtual link reads EINVAL
        return ""


@dataclass
class Iface:
    name: str
    state: str
    speed_mbps: int | None
    mtu: str
    ipv4: str = ""


@dataclass
class HcaPort:
    device: str
    port: str
    state: str        # "4: ACTIVE"
    rate: str         # "200 Gb/sec (4X HDR)"
    link_layer: str   # InfiniBand | Ethernet (RoCE)


@dataclass
class Rdma:
    ports: list[HcaPort] = field(default_factory=list)

    @property
    def devices(self) -> list[str]:
        return sorted({p.device for p in self.ports})


def ipv4_of(name: str) -> str:
    """The interface's IPv4 address (SIOCGIFADDR), '' when it has none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            return socket.inet_ntoa(res[20:24])
    except OSError:
        return ""


def interfaces(sys_class: Path = SYS) -> list[Iface]:
    out = []
    net = sys_class / "net"
    for d in sorted(net.iterdir()) if net.is_dir() else []:
        speed = _read(d / "speed")
        out.append(Iface(d.name, _read(d / "operstate") or "unknown",
                         int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
                         _read(d / "mtu"), ipv4_of(d.name) if sys_class == SYS else ""))
    return out


def rdma(sys_class: Path = SYS) -> Rdma:
    r = Rdma()
    ib = sys_class / "infiniband"
    for dev in sorted(ib.iterdir()) if ib.is_dir() else []:
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            r.ports.append(HcaPort(dev.name, port.name, _read(port / "state"), _read(port / "rate"),
                                   _read(port / "link_layer")))
    return r


def check_interfaces(ifaces: list[Iface]) -> Check:
    parts = []
    for i in ifaces:
        speed = f" {i.speed_mbps / 1000:g} Gb/s" if i.speed_mbps else ""
        ip = f" {i.ipv4}" if i.ipv4 else ""
        parts.append(f"{i.name} {i.state}{speed}{ip}")
    usable = [i for i in ifaces if i.name != "lo" and i.state in ("up", "unknown") and not i.name.startswith(("ifb",))]
    if not usable:
        return Check("interfaces", WARN, "; ".join(parts) or "none",
                     fix="no non-loopback interface is up: multi-node jobs cannot reach other nodes")
    return Check("interfaces", PASS, "; ".join(parts))


def check_rdma(r: Rdma) -> Check:
    if not r.ports:
        return Check("rdma", INFO, "no RDMA devices in /sys/class/infiniband (NCCL will use sockets between nodes)")
    detail = "; ".join(f"{p.device}:{p.port} {p.state} {p.rate} {p.link_layer}" for p in r.ports)
    down = [p for p in r.ports if "ACTIVE" not in p.state]
    if len(down) == len(r.ports):
        return Check("rdma", WARN, detail, fix="no RDMA port is ACTIVE: check cables/subnet manager (ibstat)")
    return Check("rdma", PASS, detail)


def _parse_filter(value: str) -> tuple[bool, list[tuple[str, bool, str]]]:
    """NCCL's filter syntax: optional leading '^' (exclude), items 'name[:port]', '=' for exact."""
    exclude = value.startswith("^")
    items = []
    for raw in value.lstrip("^").split(","):
        raw = raw.strip()
        if not raw:
            continue
        exact = raw.startswith("=")
        name, _, port = raw.lstrip("=").partition(":")
        items.append((name, exact, port))
    return exclude, items


def _matches(name: str, pattern: str, exact: bool) -> bool:
    return name == pattern if exact else name.startswith(pattern)


def check_ifname_var(var: str, value: str | None, ifaces: list[Iface]) -> Check:
    """NCCL_SOCKET_IFNAME uses prefixes ('eth' matches eth0); GLOO_SOCKET_IFNAME exact names."""
    if not value:
        return Check(var, INFO, "not set (the library picks an interface itself)")
    names = [i.name for i in ifaces]
    if var.startswith("GLOO"):
        missing = [n for n in value.split(",") if n.strip() and n.strip() not in names]
        if missing:
            return Check(var, FAIL, f"{value!r}: no interface {', '.join(missing)} (have {', '.join(names)})",
                         fix=f"set {var} to existing interface names, e.g. {var}={_suggest(ifaces)}")
        return Check(var, PASS, f"{value!r} exists")
    exclude, items = _parse_filter(value)
    if exclude:
        left = [n for n in names if not any(_matches(n, p, e) for p, e, _ in items)]
        if not left:
            return Check(var, FAIL, f"{value!r} excludes every interface ({', '.join(names)})",
                         fix=f"exclude fewer, e.g. {var}=^lo,docker")
        return Check(var, PASS, f"{value!r} leaves {', '.join(left)}")
    hit = [n for n in names if any(_matches(n, p, e) for p, e, _ in items)]
    if not hit:
        return Check(var, FAIL, f"{value!r} matches no interface (have {', '.join(names)})",
                     fix=f"set {var} to an existing interface (prefix), e.g. {var}={_suggest(ifaces)}")
    return Check(var, PASS, f"{value!r} matches {', '.join(hit)}")


def _suggest(ifaces: list[Iface]) -> str:
    up = [i.name for i in ifaces if i.name != "lo" and i.state == "up"]
    return up[0] if up else (ifaces[0].name if ifaces else "eth0")


def check_ib_hca(value: str | None, r: Rdma) -> Check:
    var = "NCCL_IB_HCA"
    if not value:
        return Check(var, INFO, "not set (NCCL uses every RDMA device)")
    exclude, items = _parse_filter(value)
    devs = r.devices
    if not devs:
        return Check(var, FAIL, f"{value!r} but there are no RDMA devices",
                     fix="unset NCCL_IB_HCA, or install/load the RDMA driver (ibv_devices should list devices)")
    if exclude:
        return Check(var, PASS, f"{value!r} excludes from {', '.join(devs)}")
    bad = []
    for name, exact, port in items:
        matched = [p for p in r.ports if _matches(p.device, name, exact) and (not port or p.port == port)]
        if not matched:
            bad.append(f"{name}:{port}" if port else name)
    if bad:
        have = ", ".join(f"{p.device}:{p.port}" for p in r.ports)
        return Check(var, FAIL, f"{value!r}: {', '.join(bad)} not found (have {have})",
                     fix=f"name existing devices, e.g. NCCL_IB_HCA={devs[0]}")
    return Check(var, PASS, f"{value!r} matches {', '.join(devs)}")


def route_to(host_ip: str, port: int, ifaces: list[Iface]) -> tuple[str, str]:
    """(local ip, interface) the kernel would use to reach host_ip (UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host_ip, port or 9))
        local = s.getsockname()[0]
    name = next((i.name for i in ifaces if i.ipv4 == local), "lo" if local.startswith("127.") else "?")
    return local, name


def check_master(addr: str, port: int, ifaces: list[Iface], timeout_s: float = 3.0,
                 expect_listener: bool = False) -> list[Check]:
    """Resolvable, which interface reaches it, and whether its port answers within timeout_s."""
    try:
        ip = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        return [Check("master address", FAIL, f"{addr!r} does not resolve ({e.strerror})",
                      fix="use node 0's IP address or fix DNS / /etc/hosts on this node")]
    out = [Check("master address", PASS, f"{addr} -> {ip}")]
    try:
        local, iface = route_to(ip, port, ifaces)
        out.append(Check("route to master", PASS if iface != "?" else INFO, f"via {iface} ({local})"))
    except OSError as e:
        return out + [Check("route to master", FAIL, f"no route to {ip} ({e.strerror})",
                            fix="check the default route / the interface named by NCCL_SOCKET_IFNAME")]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((ip, port))
            out.append(Check("master port", PASS, f"{ip}:{port} accepts connections"))
        except socket.timeout:
            out.append(Check("master port", FAIL, f"{ip}:{port} did not answer within {timeout_s:g} s",
                             fix="a firewall drops the traffic: open the port between nodes"))
        except OSError as e:
            if e.errno == errno.ECONNREFUSED and not expect_listener:
                out.append(Check("master port", INFO, f"{ip}:{port} reachable, nothing listening yet "
                                                      "(expected before the job starts)"))
            else:
                out.append(Check("master port", FAIL, f"{ip}:{port}: {e.strerror}",
                                 fix="start node 0 first, or check the address/port and firewall"))
    return out


def network_checks(env: dict[str, str], master_addr: str, master_port: int,
                   sys_class: Path = SYS) -> list[Check]:
    ifaces = interfaces(sys_class)
    r = rdma(sys_class)
    return [check_interfaces(ifaces), check_rdma(r),
            check_ifname_var("NCCL_SOCKET_IFNAME", env.get("NCCL_SOCKET_IFNAME"), ifaces),
            check_ifname_var("GLOO_SOCKET_IFNAME", env.get("GLOO_SOCKET_IFNAME"), ifaces),
            check_ib_hca(env.get("NCCL_IB_HCA"), r),
            *check_master(master_addr, master_port, ifaces)]
