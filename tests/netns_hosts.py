"""Two hosts with their own addresses on this machine: network namespaces joined by a veth pair.

    with netns_pair("tdm123") as hosts:      # {"ns": [a, b], "veth": [ifa, ifb], "addr": [ip_a, ip_b]}
        subprocess.run(["ip", "netns", "exec", hosts["ns"][0], ...])

Needs root and iproute2's `ip`; ``why_not()`` says why not (the tests skip with it). The
namespaces (and with them the veth pair) are removed on exit, whatever happens. ``ifname``
gives both ends the same name inside their namespaces, so one GLOO_SOCKET_IFNAME fits both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_not() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return ""


@contextlib.contextmanager
def netns_pair(tag: str, addr: tuple[str, str] = ("10.231.7.1", "10.231.7.2"), ifname: str = ""):
    """Raises RuntimeError("`ip netns add` is unavailable here: ...") when namespaces cannot be made."""
    ns = [f"{tag}a", f"{tag}b"]
    veth = [f"v{tag}a", f"v{tag}b"]
    try:
        r = ip("netns", "add", ns[0], check=False)
        if r.returncode:
            raise RuntimeError(f"`ip netns add` is unavailable here: {r.stderr.strip()}")
        ip("netns", "add", ns[1])
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in range(2):
            ip("link", "set", veth[i], "netns", ns[i])
            if ifname:
                ip("-n", ns[i], "link", "set", veth[i], "name", ifname)
                veth[i] = ifname
            ip("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
            ip("-n", ns[i], "link", "set", veth[i], "up")
            ip("-n", ns[i], "link", "set", "lo", "up")
        yield {"ns": ns, "veth": veth, "addr": list(addr)}
    finally:
        for n in ns:
            ip("netns", "del", n, check=False)  # takes its end of the veth pair with it
