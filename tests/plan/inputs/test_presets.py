"""Hardware presets against their datasheets (dense figures; a datasheet's sparse ones halved).

Sources: NVIDIA GB200 NVL72 / HGX B200 datasheet (per GPU: HGX B200 FP8 9 PF, BF16 4.5 PF, TF32 2.2 PF sparse,
FP32 75 TF, 180 GB HBM3e at 7.7 TB/s; GB200 FP8 10 PF, BF16 5 PF, TF32 2.5 PF sparse, FP32 80 TF, 186 GB at 8 TB/s;
fifth-generation NVLink 1.8 TB/s); AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s; FP32 163.4 TF, TF32
653.7 TF, FP16/BF16 1307.4 TF, FP8 2614.9 TF dense; Infinity Fabric 896 GB/s peak aggregate over 7 links);
NVIDIA Tesla P100 SXM2 datasheet (16 GB HBM2, 732 GB/s; FP32 10.6 TF, FP16 21.2 TF; NVLink 160 GB/s
bidirectional); NVIDIA L4 datasheet (24 GB, 300 GB/s; FP32 30.3 TF; TF32 120, FP16/BF16 242, FP8 485 TF sparse).
"""

import pytest

from tandem.plan.inputs.hardware import GiB, get_gpu, get_link, make_cluster

T = 1e12


@pytest.mark.parametrize("name, mem_gib, mem_tbs, peaks", [
    ("b200", 180, 7.7, {"fp32": 75, "tf32": 2200 / 2, "bf16": 4500 / 2, "fp8": 9000 / 2}),
    ("gb200", 186, 8.0, {"fp32": 80, "tf32": 2500 / 2, "bf16": 5000 / 2, "fp8": 10000 / 2}),
    ("mi300x", 192, 5.3, {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}),
    ("p100", 16, 0.732, {"fp32": 10.6, "tf32": 10.6, "fp16": 21.2}),
    ("l4", 24, 0.300, {"fp32": 30.3, "tf32": 120 / 2, "bf16": 242 / 2, "fp8": 485 / 2}),
])
def test_gpu_presets_match_their_datasheets(name, mem_gib, mem_tbs, peaks):
    g = get_gpu(name)
    assert g.memory_bytes == mem_gib * GiB and g.memory_Bps == pytest.approx(mem_tbs * 1e12)
    for prec, tf in peaks.items():
        assert g.peak(prec) == pytest.approx(tf * T, rel=0.005), prec
    assert g.source


def test_no_bf16_on_p100():
    with pytest.raises(Exception, match="p100 has no bf16"):
        get_gpu("p100").peak("bf16")


@pytest.mark.parametrize("name, kind, gbytes_per_direction", [
    ("nvlink5", "intra", 1800 / 2), ("xgmi", "intra", 896 / 2), ("nvlink1", "intra", 160 / 2),
    ("ib-xdr", "inter", 800 / 8), ("opa-100", "inter", 100 / 8), ("eth-50", "inter", 50 / 8),
])
def test_link_presets(name, kind, gbytes_per_direction):
    assert get_link(name, kind).bandwidth_Bps == pytest.approx(gbytes_per_direction * 1e9)


def test_each_gpu_brings_its_usual_link_and_aliases_resolve():
    assert make_cluster("b200").intra.name == "nvlink5" and make_cluster("mi300x").intra.name == "xgmi"
    assert make_cluster("p100").intra.name == "nvlink1" and make_cluster("l4").intra.name == "pcie4"
    assert get_gpu("gb200-nvl72").name == "gb200" and get_link("omnipath", "inter").name == "opa-100"
    nvl72 = make_cluster("gb200", gpus_per_node=72, nodes=1)
    assert nvl72.world == 72 and nvl72.intra.name == "nvlink5"
