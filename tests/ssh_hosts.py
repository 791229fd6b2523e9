"""Two ssh hosts on this machine: a network namespace each (netns_hosts.py), each running its own sshd.

    sshd, why = sshd_binary()                 # the system's, else Debian's openssh-server unpacked into
                                              # ~/.cache/tandem/ssh (daemons.py); None + why
    with SshHosts(tmp_dir, sshd, hosts) as h: # sshd on port 22 in each namespace, key login as root
        subprocess.run(["ssh", "-F", h.config, hosts["addr"][1], "true"])   # from inside a namespace

Nothing is installed system-wide. sshd runs as root and wants its privilege-separation user
(`sshd`) and directory (/run/sshd), which a machine without openssh-server lacks: each sshd
starts in the private mount namespace `ip netns exec` makes, with a copy of /etc/passwd that
has the user bind-mounted over the real one and a tmpfs on /run; the host outside sees none of
it. Every sshd is started with ``MARK`` in its environment and every agent the tests start gets
it through tandem's env allowlist (a TANDEM_* variable), so ``strays()`` finds whatever is left.

    python tests/ssh_hosts.py --fetch-only    # CI's fetch step
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

from daemons import Daemons, fetch_debs, kill_all, marked

PACKAGES = ["openssh-server", "libwrap0"]
LIBS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")
MARK = "TANDEM_TEST_SSH_MARK"


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR_SSH") or os.path.expanduser("~/.cache/tandem/ssh"))


def sshd_binary() -> tuple[Path | None, str]:
    """(absolute path of an sshd, "") or (None, why not): the system's, else Debian's package, fetched once.
    The client (ssh, ssh-keygen) is fetched too where the system has none; ``client_path()`` finds it."""
    if not client_path():
        why = fetch_debs(["openssh-client"], cache_dir() / "client")
        if why or not client_path():
            return None, why or "openssh-client unpacked, but no ssh in it"
    for p in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if p and Path(p).is_file():
            return Path(p), ""
    sshd = cache_dir() / "root/usr/sbin/sshd"
    if not sshd.exists():
        why = fetch_debs(PACKAGES, cache_dir() / "root")
        if why:
            return None, why
    return sshd, ""


def client_path() -> str:
    """The PATH under which `ssh` and `ssh-keygen` are found (the system's, else the fetched client's), or ""."""
    fetched = cache_dir() / "client/usr/bin"
    path = os.environ.get("PATH", "") + (os.pathsep + str(fetched) if fetched.is_dir() else "")
    return path if shutil.which("ssh", path=path) and shutil.which("ssh-keygen", path=path) else ""


SSHD_CONFIG = """\
Port 22
ListenAddress {addr}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
PidFile {dir}/sshd-{i}.pid
"""

CLIENT_CONFIG = """\
Host *
  User root
  Port 22
  IdentityFile {dir}/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile {dir}/known_hosts
  StrictHostKeyChecking yes
  LogLevel ERROR
"""


class SshHosts(Daemons):
    """An sshd in each namespace of ``hosts``; ``config`` is the client's ssh_config (key, known_hosts)."""

    def __init__(self, workdir: Path, sshd: Path, hosts: dict):
        self.dir, self.sshd, self.hosts = Path(workdir), Path(sshd), hosts
        self.config = str(self.dir / "ssh_config")
        self.procs: list[subprocess.Popen] = []
        self.mark = f"{MARK}={self.dir}"

    def start(self, timeout: float = 30) -> None:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        for key in ("host_key", "id_ed25519"):
            keygen = shutil.which("ssh-keygen", path=client_path()) or "ssh-keygen"
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
        (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
        host_pub = " ".join((d / "host_key.pub").read_text().split()[:2])
        (d / "known_hosts").write_text(f"{','.join(self.hosts['addr'])} {host_pub}\n")
        Path(self.config).write_text(CLIENT_CONFIG.format(dir=d))
        mounts = []
        try:
            pwd.getpwnam("sshd")
        except KeyError:  # the privilege-separation user, in this mount namespace only
            (d / "passwd").write_text(Path("/etc/passwd").read_text() + "sshd:x:65534:65534::/run/sshd:/bin/false\n")
            mounts.append(f"mount --bind {d}/passwd /etc/passwd")
        if not Path("/run/sshd").is_dir():
            mounts += ["mount -t tmpfs tmpfs /run", "mkdir -m 755 /run/sshd"]
        root = self.sshd.parents[2]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", MARK: str(d),
               "LD_LIBRARY_PATH": ":".join(str(root / lib) for lib in LIBS)}
        for i, (ns, addr) in enumerate(zip(self.hosts["ns"], self.hosts["addr"])):
            (d / f"sshd-{i}.conf").write_text(SSHD_CONFIG.format(addr=addr, dir=d, i=i))
            script = " && ".join([*mounts, f"exec {self.sshd} -D -e -f {d}/sshd-{i}.conf"])
            log = open(d / f"sshd-{i}.log", "w")
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", script], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self.procs):
            log = d / f"sshd-{i}.log"
            while "Server listening" not in log.read_text():
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd {i} did not come up (rc {p.poll()}): {log.read_text()[-800:]}")
                time.sleep(0.05)

    def strays(self, mark: str = "") -> list[int]:
        """Live processes (not zombies) whose environment holds ``mark`` (default: this instance's, which its
        sshds and their sessions carry; a job's agents and workers carry the one the test passed on)."""
        return marked((mark or self.mark).encode())

    def stop(self) -> None:
        kill_all(self.procs, self.strays)   # what still outlives SIGKILL, the tests' strays() check names

if __name__ == "__main__":
    sshd, why = sshd_binary()
    if sshd is None:
        sys.exit(f"no sshd for the ssh tests: {why}")
    print(f"sshd for the ssh tests: {sshd}")
