"""A job's nodes, node rank and master from the scheduler that started it (a Slurm step, a Kubeflow pod),
for `tandem launch --cluster auto`."""

from __future__ import annotations

import dataclasses
import os

from tandem.core.environment import from_kubeflow
from tandem.core.spec import LaunchSpec
from tandem.launch.slurm_env import slurm_env, slurm_rendezvous


def from_cluster(launch: LaunchSpec, env=os.environ) -> LaunchSpec:
    """Inside a Slurm step or a Kubeflow pod (PET_*), fill nodes, node rank and master from the scheduler's
    env (flags the user gave win)."""
    given = launch.nnodes != "1" or launch.node_rank or launch.rdzv_endpoint or launch.simulate_nodes
    job = None if given else slurm_env(env)
    if job is None and not given:
        return _from_kubeflow(launch, env)
    if job is None or job.nnodes == 1:  # one node: the private standalone store is the better rendezvous
        return launch
    rdzv = slurm_rendezvous(env)
    if rdzv is None:
        return launch
    addr = launch.master_addr if launch.master_addr != "127.0.0.1" else rdzv.master_addr
    port = launch.master_port if launch.master_port != 29500 else rdzv.master_port
    return dataclasses.replace(launch, nnodes=str(rdzv.nnodes), node_rank=rdzv.node_rank, master_addr=addr,
                               master_port=port)


def _from_kubeflow(launch: LaunchSpec, env) -> LaunchSpec:
    node = from_kubeflow(env)
    if node is None:
        return launch
    nproc = node.nproc_per_node if node.nproc_per_node and launch.nproc_per_node == 1 else launch.nproc_per_node
    if node.nnodes == 1:  # one node: the private standalone store is the better rendezvous
        return dataclasses.replace(launch, nproc_per_node=nproc)
    addr = launch.master_addr if launch.master_addr != "127.0.0.1" else node.master_addr
    port = launch.master_port if launch.master_port != 29500 else node.master_port
    return dataclasses.replace(launch, nproc_per_node=nproc, nnodes=str(node.nnodes), node_rank=node.node_rank,
                               master_addr=addr, master_port=port)
