import pytest

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.training import Strategy, Training


@pytest.fixture
def plan_of():
    def run(model, cluster, strategy=None, **train):
        t = Training(**train)
        s = strategy or Strategy(dp=cluster.world)
        validate(model, cluster, t, s)
        return evaluate(model, cluster, t, s)
    return run


@pytest.fixture
def seed_cluster():
    """The seed's case: 2 nodes x 2 A100-80GB, RoCE v2 25 Gb/s (shared/seed, section 五)."""
    return lambda inter="roce-25": make_cluster("a100-80gb", gpus_per_node=2, nodes=2, inter=inter)
