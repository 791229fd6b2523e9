"""Where a process runs: its place in the job, and the device and backend it uses.

Two questions every worker (and the launcher) asks, answered here only:

    env = ClusterEnv.detect()            # rank, world, local rank, node, master, from the environment
    device, backend = resolve_device()   # "cuda"/"nccl" where GPUs exist, "cpu"/"gloo" otherwise

``ClusterEnv.detect(env)`` asks each reader in ``READERS`` in turn; the first that recognises
the environment wins, and a process that none recognises is a world of one. Two readers exist:
Ray Train's workers (``from_ray``) and torchrun's variables (what `tandem launch` and torchrun
export to every worker). A scheduler that starts the workers itself (Slurm's srun: ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``; a Kubernetes job's indexed pods) gets a reader of its own:
a function ``(env: Mapping[str, str]) -> ClusterEnv | None`` put in ``READERS`` before torchrun's,
returning None when its variables are absent.

A scheduler that starts one agent per node instead describes the node, not the process:
``from_kubeflow(env) -> NodeEnv | None`` reads Kubeflow Trainer's ``PET_*`` variables (what
torchrun would read), and `tandem launch --cluster auto` takes nodes, node rank, master and
workers per node from it (Slurm's equivalent: tandem/launch/slurm_env.py). No torch import here: the CLI imports this at
start-up; ``resolve_device`` imports torch only to ask whether CUDA is there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from tandem.core.errors import ConfigError

# The launcher's choice, exported to its workers: an "auto" in a worker means what the launcher chose.
ENV_DEVICE, ENV_BACKEND = "TANDEM_DEVICE", "TANDEM_BACKEND"


@dataclass(frozen=True)
class ClusterEnv:
    """One process's place in a job, as its launcher or scheduler described it."""
    rank: int = 0                 # global rank
    world: int = 1                # world size
    local_rank: int = 0           # rank on this node (the GPU index)
    local_world: int = 1          # processes on this node
    node: int = 0                 # this node's rank among the nodes (torchrun's GROUP_RANK)
    master_addr: str = ""         # the rendezvous store's host ("" when no launcher set one up)
    master_port: int = 0
    source: str = "single"        # who described it: single | torchrun | ray (| slurm, k8s as readers come)

    @property
    def distributed(self) -> bool:
        """Whether a process group can be joined (a launcher published a master to meet at)."""
        return bool(self.master_addr)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> "ClusterEnv":
        """The first reader's answer for ``env`` (default: this process's environment), else a world of one."""
        env = os.environ if env is None else env
        for read in READERS:
            found = read(env)
            if found is not None:
                return found
        return cls()


def from_torchrun(env: Mapping[str, str]) -> ClusterEnv | None:
    """torchrun's (and `tandem launch`'s) variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR, MASTER_PORT. None when RANK is absent."""
    if "RANK" not in env:
        return None
    return ClusterEnv(rank=int(env["RANK"]), world=int(env.get("WORLD_SIZE", 1)),
                      local_rank=int(env.get("LOCAL_RANK", 0)), local_world=int(env.get("LOCAL_WORLD_SIZE", 1)),
                      node=int(env.get("GROUP_RANK", 0)), master_addr=env.get("MASTER_ADDR", ""),
                      master_port=int(env.get("MASTER_PORT", 0)), source="torchrun")


def from_ray(env: Mapping[str, str]) -> ClusterEnv | None:
    """A Ray Train worker (`tandem submit --on ray`): Ray forms the process group and exports torchrun's
    names, except that the node is NODE_RANK (no GROUP_RANK); a Ray worker process has RAY_RAYLET_PID.
    Ray ranks nodes by IP address, so nodes that share one (a test cluster on one machine) count as one."""
    if "RANK" not in env or "NODE_RANK" not in env or "GROUP_RANK" in env or "RAY_RAYLET_PID" not in env:
        return None
    return replace(from_torchrun(env), node=int(env["NODE_RANK"]), source="ray")


READERS: tuple[Callable[[Mapping[str, str]], ClusterEnv | None], ...] = (from_ray, from_torchrun)


@dataclass(frozen=True)
class NodeEnv:
    """One node's place in a job whose scheduler starts one agent (`tandem launch`) per node."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int | None    # None: the scheduler left it to the launcher ("auto", "gpu", unset)
    source: str


PET = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def from_kubeflow(env: Mapping[str, str]) -> NodeEnv | None:
    """Kubeflow Trainer's torch runtime (and PyTorchJob's elastic mode) describe each pod to torchrun with
    ``PET_*`` variables, torchrun's own options by name: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
    PET_MASTER_PORT, PET_NPROC_PER_NODE. None when PET_NNODES is absent; one set but not the others, or a
    value that is not a number, is an error (the pod would otherwise wait for a rendezvous that never forms)."""
    if "PET_NNODES" not in env:
        return None
    missing = [k for k in PET if not env.get(k)]
    if missing:
        raise ConfigError(f"{missing[0]} is not set while PET_NNODES is", field=missing[0], value=None,
                          fix=f"set {', '.join(PET)} together (Kubeflow Trainer does), or unset PET_NNODES")
    nums = {}
    for k in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_PORT"):
        try:
            nums[k] = int(env[k])
        except ValueError:
            raise ConfigError("not an integer", field=k, value=env[k],
                              fix="give a plain number (an elastic MIN:MAX needs --rdzv-endpoint flags)") from None
    nproc = env.get("PET_NPROC_PER_NODE", "")
    return NodeEnv(nnodes=nums["PET_NNODES"], node_rank=nums["PET_NODE_RANK"], master_addr=env["PET_MASTER_ADDR"],
                   master_port=nums["PET_MASTER_PORT"], nproc_per_node=int(nproc) if nproc.isdigit() else None,
                   source="kubeflow")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str | None = "auto", backend: str | None = "auto",
                   env: Mapping[str, str] | None = None, *, field: str = "launch.device") -> tuple[str, str]:
    """(device, backend): what was asked for, else the launcher's choice in ``env``, else cuda + nccl
    where a GPU is visible and cpu + gloo otherwise.

    ``env``: a worker passes its environment (``os.environ``), whose TANDEM_DEVICE/TANDEM_BACKEND
    fill an "auto"; the launcher, which makes that choice, passes none. None counts as "auto".
    ``field`` names the option in the error when cuda is asked for and none is visible.
    """
    env = env or {}
    device = device if device not in (None, "auto") else env.get(ENV_DEVICE) or "auto"
    backend = backend if backend not in (None, "auto") else env.get(ENV_BACKEND) or "auto"
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    elif device == "cuda" and not cuda_available():
        raise ConfigError("no CUDA device is visible", field=field, value="cuda", fix=f"use {field}=cpu (or auto)")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend
