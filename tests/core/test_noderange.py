"""launch.nnodes as numbers: NodeRange.parse, its errors, torchrun's text back, the simulated nodes' range."""

import pytest

from tandem.core.errors import ConfigError
from tandem.core.noderange import NodeRange
from tandem.core.spec import LaunchSpec
from tandem.core.validate import node_counts, world_sizes


@pytest.mark.parametrize("text,nodes,back", [("1", (1, 1), "1"), ("2", (2, 2), "2"), ("1:4", (1, 4), "1:4"),
                                             ("3:3", (3, 3), "3"), (" 2", (2, 2), "2")])
def test_parse_and_torchruns_text_back(text, nodes, back):
    r = NodeRange.parse(text)
    assert (r.min, r.max) == nodes and str(r) == back and r.elastic == (nodes[0] != nodes[1])
    assert NodeRange.parse(str(r)) == r


@pytest.mark.parametrize("text,words", [("two", "expected N or MIN:MAX"), ("1:x", "expected N or MIN:MAX"),
                                        ("2:1", "'2:1' is not a valid range"), ("0", "need 1 <= MIN <= MAX")])
def test_parse_errors_name_the_field(text, words):
    with pytest.raises(ConfigError, match=words) as e:
        NodeRange.parse(text, "--nnodes")
    assert e.value.field == "--nnodes" and "--nnodes 1:4" in e.value.fix


@pytest.mark.parametrize("kw,nodes", [(dict(), (1, 1)), (dict(nnodes="1:3"), (1, 3)),
                                      (dict(simulate_nodes=3), (3, 3)), (dict(simulate_nodes=3, nnodes="3"), (3, 3)),
                                      (dict(simulate_nodes=3, nnodes="2:3"), (2, 3))])
def test_the_jobs_nodes_simulated_ones_included(kw, nodes):
    launch = LaunchSpec(nproc_per_node=2, **kw)
    assert node_counts(launch) == NodeRange(*nodes)
    assert world_sizes(launch) == (2 * nodes[0], 2 * nodes[1])
