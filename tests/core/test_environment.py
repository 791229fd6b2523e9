"""tandem.core.environment: the one place that reads a worker's place in the job and picks device/backend."""

import pytest

from tandem.core import environment
from tandem.core.environment import ClusterEnv, resolve_device
from tandem.core.errors import ConfigError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_torchrun_variables():
    env = ClusterEnv.detect(TORCHRUN)
    assert env == ClusterEnv(rank=3, world=4, local_rank=1, local_world=2, node=1, master_addr="10.0.0.1",
                             master_port=29500, source="torchrun")
    assert env.distributed


def test_no_launcher_is_a_world_of_one():
    env = ClusterEnv.detect({"PATH": "/bin"})
    assert (env.rank, env.world, env.source, env.distributed) == (0, 1, "single", False)


def test_a_scheduler_reader_goes_first(monkeypatch):
    """How the Slurm/Kubernetes work extends it: a reader of its own variables, asked before torchrun's."""
    def from_slurm(env):
        if "SLURM_PROCID" not in env:
            return None
        return ClusterEnv(rank=int(env["SLURM_PROCID"]), world=int(env["SLURM_NTASKS"]), source="slurm")

    monkeypatch.setattr(environment, "READERS", (from_slurm, environment.from_torchrun))
    assert ClusterEnv.detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", **TORCHRUN}).source == "slurm"
    assert ClusterEnv.detect(TORCHRUN).source == "torchrun"


@pytest.mark.parametrize("cuda", [False, True])
def test_device_and_backend(monkeypatch, cuda):
    monkeypatch.setattr(environment, "cuda_available", lambda: cuda)
    auto = ("cuda", "nccl") if cuda else ("cpu", "gloo")
    assert resolve_device() == auto
    assert resolve_device(None, None) == auto
    assert resolve_device("cpu") == ("cpu", "gloo")
    assert resolve_device("auto", "gloo") == (auto[0], "gloo")
    # a worker: the launcher's choice fills "auto"; what the worker was told wins over it
    launcher = {"TANDEM_DEVICE": "cpu", "TANDEM_BACKEND": "gloo"}
    assert resolve_device("auto", "auto", launcher) == ("cpu", "gloo")
    assert resolve_device("auto", "auto", {}) == auto
    if not cuda:
        with pytest.raises(ConfigError, match="launch.device: no CUDA device is visible"):
            resolve_device("cuda")
        with pytest.raises(ConfigError, match="--device: no CUDA"):
            resolve_device("cuda", env=launcher, field="--device")
    else:
        assert resolve_device("cuda", "auto", launcher) == ("cuda", "gloo")
