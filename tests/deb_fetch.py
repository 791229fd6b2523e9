"""Debian packages for the tests' real daemons (sshd, Slurm), unpacked into a cache folder.

    why = fetch_debs(["openssh-server", "libwrap0"], cache / "root")   # "" once ROOT holds them

Nothing is installed system-wide: `apt-get download` fetches the .deb files (no root needed, no
dependency resolution: callers name every package) and `dpkg -x` unpacks each into a folder of
its own, renamed into place at the end. Standard library only: .ci/run calls the fetch through
``python3 tests/<helper>.py --fetch-only`` before the suite's environment exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


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
