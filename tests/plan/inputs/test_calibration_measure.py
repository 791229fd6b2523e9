import json

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.inputs import calibration
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.terms.collectives import all_reduce, layout


def doc(**over):
    d = {"schema": "tandem.calibration/1", "created": "2026-01-01T00:00:00+00:00", "host": "h", "backend": "nccl",
         "device": "cuda", "world_size": 4, "nnodes": 2,
         "links": {"intra_node": {"bandwidth_Bps": 200e9, "latency_s": 20e-6, "group_size": 2,
                                  "collectives": {"all_reduce": {"alpha_s": 2e-5, "beta_s_per_byte": 5e-12,
                                                                 "busbw_Bps": 200e9}}},
                   "inter_node": {"bandwidth_Bps": 2.5e9, "latency_s": 60e-6, "group_size": 2}},
         "compute": {"achieved_flops": {"tf32": 120e12}}}
    d.update(over)
    return d


def test_calibration_replaces_datasheet(tmp_path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(doc()))
    c = calibration.load(p, make_cluster("a100-80gb", 2, 2, inter="roce-25"))
    assert c.intra.bandwidth_Bps == 200e9
    assert c.node_bandwidth_Bps == pytest.approx(2.5e9)      # one rank per node: busbw is the node's
    assert c.intra.latency_s == pytest.approx(20e-6 / 2)     # per-call alpha over 2(n-1) ring steps
    assert c.flops_ref("tf32") == 120e12
    # the seed's 102.4 MB now takes 102.4e6 / 2.5e9 = 41 ms across the two nodes
    t = all_reduce(102.4e6, layout(4, 1, 2), c, calls=0)
    assert t == pytest.approx(102.4e6 / 2.5e9 + 2 * 0.5 * 102.4e6 / 200e9)  # + RS and AG inside the node


@pytest.mark.parametrize("bad", [{"schema": "other/1"}, {"links": {"intra_node": {"bandwidth_Bps": -1}}}])
def test_bad_calibration(tmp_path, bad):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(doc(**bad)))
    with pytest.raises(ConfigError) as e:
        calibration.load(p, make_cluster())
    assert e.value.field == "calibration"


def test_missing_calibration_file(tmp_path):
    with pytest.raises(ConfigError):
        calibration.load(tmp_path / "nope.json", make_cluster())


def test_measure_on_meta_matches_presets():
    pytest.importorskip("tandem.models")
    from tandem.plan.inputs.measure import measure
    from tandem.plan.inputs.model import CNN_PRESETS

    m = measure("tandem.models.resnet:resnet18", "3,224,224", {"num_classes": 1000})
    p = CNN_PRESETS["resnet18"]
    assert m.params == p["params"] == 11_689_512     # He et al. 2015 / torchvision
    assert m.fwd_flops_per_sample == p["fwd"]        # 1.8 GMAC (paper) = 3.6 GFLOP
    assert m.act_bytes_per_sample_fp32 == p["act"]


def test_measure_bad_path():
    from tandem.plan.inputs.measure import measure
    with pytest.raises(ConfigError):
        measure("no.such.module:f")
