"""Which rendezvous store the workers of each kind of launch get (launcher._worker_env)."""

import os

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from tandem.core.spec import LaunchSpec
from tandem.launch import launcher

SHARE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@pytest.mark.parametrize("nnodes, max_restarts, fresh_store", [
    ("1", 0, False),     # one attempt: the workers join the store the agent holds open
    ("2", 0, False),     # fixed-size multi-node: no restart, no waiting node restarts the group
    ("2:2", 0, False),
    ("1", 2, True),      # failures (the watchdog's kill among them) restart the group
    ("1:2", 0, True),    # elastic: a node joining or lost restarts it without counting a restart
])
def test_store_shared_only_for_a_single_attempt(tmp_path, monkeypatch, nnodes, max_restarts, fresh_store):
    # a value left by an earlier launch in this process must not decide this one
    monkeypatch.setattr(os, "environ", {**os.environ, SHARE_OFF: "0" if fresh_store else "1"})
    launcher._worker_env(LaunchSpec(nnodes=nnodes, max_restarts=max_restarts, device="cpu", backend="gloo"),
                         tmp_path, nodes_here=1)
    assert (os.environ.get(SHARE_OFF) == "1") is fresh_store
    # what torch's c10d rendezvous then tells the workers (TORCHELASTIC_USE_AGENT_STORE): it reads
    # the variable and nothing else (the static rendezvous shares its store always)
    assert DynamicRendezvousHandler.use_agent_store.fget(None) is not fresh_store
