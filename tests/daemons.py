"""The tests' real daemons (sshd, Slurm): their Debian packages, and every process they leave.

    why = fetch_debs(["openssh-server", "libwrap0"], cache / "root")   # "" once ROOT holds them
    pids = marked(b"SLURM_CONF=/tmp/x/slurm.conf")                     # live processes carrying it
    left = kill_all(procs, lambda: marked(mark))                       # [] once every one is gone
    class SlurmCluster(Daemons): ...                                   # start()/stop() as `with`

Nothing is installed system-wide: `apt-get download` fetches the .deb files (no root needed, no
dependency resolution: callers name every package) and `dpkg -x` unpacks each into a folder of
its own, renamed into place at the end. Standard library only: .ci/run calls the fetch through
``python3 tests/<helper>.py --fetch-only`` before the suite's environment exists.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


class Daemons:
    """``with``: start(), and stop() at the end; a start() that fails half-way stops what it started."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def fetch_debs(packages: list[str], root: Path) -> str:
    """apt-get download + dpkg -x of ``packages`` into ``root``, atomically (a whole folder or none);
    "" when done, else why not. Work folders sit beside ``root`` (the rename stays on one file system),
    one per process: two sessions may fetch at once, and the first to finish wins."""
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        return f"fetching {' '.join(packages)} needs apt-get and dpkg (Debian/Ubuntu)"
    root = Path(root)
    debs = root.parent / f".debs-{os.getpid()}"
    debs.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["apt-get", "download", *packages], cwd=debs, capture_output=True, text=True)
        if r.returncode != 0:  # an empty package index (a fresh container): update once, then retry
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
            r = subprocess.run(["apt-get", "download", *packages], cwd=debs, capture_output=True, text=True)
        if r.returncode != 0:
            return f"apt-get download {' '.join(packages)} failed: {r.stderr.strip()[-300:]}"
        tmp = root.parent / f".{root.name}-{os.getpid()}"
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(tmp)], check=True)
        try:
            tmp.rename(root)
        except OSError:  # another session got there first: use theirs, never replace a folder in use
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(debs, ignore_errors=True)
    return ""


def marked(mark: bytes) -> list[int]:
    """Live processes (not zombies) whose environment holds ``mark`` (NAME=VALUE), never this process or a
    shell above it that exported it. A daemon's children that leave its process group (setsid: sshd's
    sessions, slurmstepd, the jobs' tasks) still carry the environment that ties them to one test."""
    mark, found, mine = mark + b"\0", [], _ancestors()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            if mark in (d / "environ").read_bytes() and " Z " not in (d / "stat").read_text().split(")", 1)[1][:3]:
                found.append(int(d.name))
        except OSError:
            continue
    return found


def kill_all(procs: list[subprocess.Popen], strays) -> list[int]:
    """SIGKILL each daemon's process group, reap it, then SIGKILL what ``strays()`` finds until it finds
    nothing (about 5 s); ``procs`` is emptied. The pids that outlived that, [] when none."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait(timeout=30)
    procs.clear()
    for _ in range(50):
        left = strays()
        if not left:
            return []
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return strays()


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids
