"""Node-local checks: library versions, GPUs, /dev/shm, open-files limit, free disk."""

from __future__ import annotations

import os
import platform
import resource
import shutil
from pathlib import Path

from tandem.diagnose.checks import FAIL, INFO, PASS, WARN, Check

GiB = 1 << 30
SHM_MIN = 1 * GiB          # Docker's 64 MB default breaks DataLoader workers and NCCL's SHM transport
NOFILE_MIN = 8192          # each DataLoader worker, socket and shared-memory segment holds descriptors
DISK_WARN, DISK_FAIL = 10 * GiB, 1 * GiB


def versions() -> dict[str, str]:
    """What must match on every node: a mismatch makes NCCL or pickled objects disagree."""
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda or "none", "cudnn": "none", "nccl": "none", "driver": "none"}
    if torch.cuda.is_available():
        v["cudnn"] = str(torch.backends.cudnn.version())
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            pass
    drv = Path("/proc/driver/nvidia/version")
    if drv.is_file():
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        words = drv.read_text().split()
        v["driver"] = next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), "unknown")
    return v


def check_versions() -> Check:
    v = versions()
    return Check("versions", INFO, ", ".join(f"{k} {val}" for k, val in v.items()))


def check_gpus(device: str, nproc_per_node: int) -> Check:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and n == 0):
        return Check("gpus", INFO, f"{n} visible; this run uses the CPU (gloo)")
    if n == 0:
        return Check("gpus", FAIL, "no CUDA device visible", fix="check the driver (nvidia-smi), "
                     "CUDA_VISIBLE_DEVICES and that torch is a CUDA build, or use --device cpu")
    if n < nproc_per_node:
        return Check("gpus", FAIL, f"{n} visible, {nproc_per_node} workers asked per node",
                     fix=f"use --nproc-per-node {n} or expose more GPUs (CUDA_VISIBLE_DEVICES)")
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return Check("gpus", PASS, f"{n} visible ({', '.join(names)}), {nproc_per_node} workers per node")


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("/dev/shm", FAIL, f"cannot stat {path}: {e.strerror}",
                     fix="mount a tmpfs at /dev/shm (docker: --shm-size=16g or --ipc=host)")
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    detail = f"{size / GiB:.1f} GiB ({free / GiB:.1f} GiB free)"
    if size < SHM_MIN:
        return Check("/dev/shm", WARN, detail + ": below 1 GiB",
                     fix="docker run --shm-size=16g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory")
    return Check("/dev/shm", PASS, detail)


def check_nofile(minimum: int = NOFILE_MIN) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fmt = lambda x: "unlimited" if x == resource.RLIM_INFINITY else str(x)  # noqa: E731
    detail = f"soft {fmt(soft)}, hard {fmt(hard)}"
    if soft != resource.RLIM_INFINITY and soft < minimum:
        return Check("open files", WARN, detail + f": below {minimum}",
                     fix=f"ulimit -n {minimum} before launching (or raise nofile in /etc/security/limits.conf)")
    return Check("open files", PASS, detail)


def check_disk(path: str | Path) -> Check:
    """Free space where checkpoints go; the nearest existing parent when the folder is not made yet."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    detail = f"{free / GiB:.1f} GiB free at {p}"
    name = "free disk"
    if free < DISK_FAIL:
        return Check(name, FAIL, detail, fix="free space or point --checkpoint-path at a bigger volume")
    if free < DISK_WARN:
        return Check(name, WARN, detail + " (a ResNet-50 checkpoint with optimizer state is ~300 MB)",
                     fix="free space or point --checkpoint-path at a bigger volume")
    return Check(name, PASS, detail)


def node_checks(device: str, nproc_per_node: int, checkpoint_path: str | Path) -> list[Check]:
    return [check_versions(), check_gpus(device, nproc_per_node), check_shm(), check_nofile(),
            check_disk(checkpoint_path)]
