"""GPU, link and cluster presets, and the YAML cluster file.

Numbers are datasheet values (dense, no sparsity); sources are listed per entry
and in docs/plan.md. Links also carry the achievable bus bandwidth nccl-tests reports, with
its source, which the collective model uses. Bandwidths are bytes/s in ONE direction: what one GPU (intra)
or one NIC (inter) can push while it also receives. A calibration file
(``tandem bench``) replaces them with measured values.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tandem.core.errors import ConfigError

GiB = 1024**3
GB = 1e9
T = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float                 # capacity as nvidia-smi reports it
    peak_flops: dict[str, float]        # precision -> dense peak FLOP/s
    intra_default: str                  # the link its usual servers have between GPUs
    source: str = ""
    memory_Bps: float = 0.0             # HBM/GDDR bandwidth (datasheet); 0: unknown (no roofline term)

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ConfigError(f"{self.name} has no {precision} tensor math", field="precision",
                              value=precision, fix=f"use one of {', '.join(self.peak_flops)}")
        return self.peak_flops[precision]


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_Bps: float   # per direction: per GPU for intra-node links, per NIC for networks
    latency_s: float       # per ring step (alpha); rough, replace with a calibration
    kind: str              # "intra" | "inter"
    source: str = ""
    # Achievable bus bandwidth, per GPU (intra) or per NIC (inter): what nccl-tests reports as busbw for large
    # messages on this link, the rate collectives are modelled at; 0: no published figure, the line rate.
    busbw_Bps: float = 0.0
    busbw_source: str = ""

    @property
    def rate_Bps(self) -> float:
        """What a collective moves per second through this link: nccl-tests' busbw where published, else the
        datasheet rate."""
        return self.busbw_Bps or self.bandwidth_Bps


def _g(name, mem, fp32, tf32, bf16, fp16, fp8, intra, src, bw=0.0):
    peaks = {"fp32": fp32 * T, "tf32": tf32 * T}
    if bf16:
        peaks["bf16"] = bf16 * T
    peaks["fp16"] = fp16 * T
    if fp8:
        peaks["fp8"] = fp8 * T
    return GPU(name, mem, peaks, intra, src, bw * GB)


# name: memory, FP32, TF32, BF16, FP16, FP8 (TFLOP/s dense), usual intra-node link, source, memory GB/s
GPUS: dict[str, GPU] = {g.name: g for g in [
    # V100 has no TF32/BF16: "tf32" runs at the FP32 rate.
    _g("v100-32gb", 32 * GiB, 15.7, 15.7, None, 125, None, "nvlink2", "NVIDIA V100 datasheet (SXM2)", 900),
    _g("a100-40gb", 40 * GiB, 19.5, 156, 312, 312, None, "nvlink3", "NVIDIA A100 datasheet (SXM)", 1555),
    _g("a100-80gb", 80 * GiB, 19.5, 156, 312, 312, None, "nvlink3", "NVIDIA A100 datasheet (SXM)", 2039),
    _g("a100-40gb-pcie", 40 * GiB, 19.5, 156, 312, 312, None, "pcie4", "NVIDIA A100 datasheet (PCIe)", 1555),
    _g("a100-80gb-pcie", 80 * GiB, 19.5, 156, 312, 312, None, "pcie4", "NVIDIA A100 datasheet (PCIe)", 1935),
    _g("h100-sxm", 80 * GiB, 67, 494.7, 989.4, 989.4, 1978.9, "nvlink4", "NVIDIA H100 datasheet (SXM)", 3350),
    # Meta's Grand Teton H100s (torchtitan's benchmarks, pytorch/torchtitan docs/performance.md): 96 GB HBM2e at
    # 2.4 TB/s, the default 500 W power limit; "the actual peak TFLOPs number is between SXM and NVL" (its
    # footnote 2): the midpoint of the H100 SXM and H100 NVL datasheet figures (NVL dense: BF16 835.5, FP8 1670.5,
    # TF32 417.5, FP32 60) is taken.
    _g("h100-sxm-500w", 96 * GiB, 63.5, 456.1, 912.45, 912.45, 1824.7, "nvlink4", "torchtitan docs/performance.md"
       " (Grand Teton: HBM2e 2.4 TB/s, 500 W; peak between H100 SXM and NVL: their datasheets' midpoint)", 2400),
    _g("h100-pcie", 80 * GiB, 51, 378, 756, 756, 1513, "pcie5", "NVIDIA H100 datasheet (PCIe)", 2000),
    _g("h200", 140 * GiB, 67, 494.7, 989.4, 989.4, 1978.9, "nvlink4", "NVIDIA H200 datasheet (SXM)", 4800),
    _g("l40s", 45 * GiB, 91.6, 183, 362.05, 362.05, 733, "pcie4", "NVIDIA L40S datasheet", 864),
    # GeForce: FP16/BF16 tensor rate with FP32 accumulate (what training uses) is half the FP16-acc rate.
    _g("rtx4090", 24 * GiB, 82.6, 82.6, 165.2, 165.2, 330.3, "pcie4", "NVIDIA Ada whitepaper, RTX 4090", 1008),
    # P100 has no tensor cores: "tf32" runs at the FP32 rate, FP16 at twice it (no BF16).
    _g("p100", 16 * GiB, 10.6, 10.6, None, 21.2, None, "nvlink1", "NVIDIA Tesla P100 datasheet (SXM2)", 732),
    _g("l4", 24 * GiB, 30.3, 60, 121, 121, 242.5, "pcie4", "NVIDIA L4 datasheet (dense: half the sparse "
       "figures)", 300),
    # Blackwell: NVIDIA's GB200 NVL72 / HGX B200 datasheet per GPU, sparse figures halved for dense.
    _g("b200", 180 * GiB, 75, 1100, 2250, 2250, 4500, "nvlink5", "NVIDIA HGX B200 datasheet, per GPU "
       "(dense = sparse / 2)", 7700),
    _g("gb200", 186 * GiB, 80, 1250, 2500, 2500, 5000, "nvlink5", "NVIDIA GB200 NVL72 datasheet, per GPU "
       "(dense = sparse / 2); one NVLink domain of 72 GPUs: --gpus-per-node 72", 8000),
    _g("mi300x", 192 * GiB, 163.4, 653.7, 1307.4, 1307.4, 2614.9, "xgmi", "AMD Instinct MI300X datasheet "
       "(dense)", 5300),
]}

ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "v100": "v100-32gb", "4090": "rtx4090",
           "b200-sxm": "b200", "gb200-nvl72": "gb200", "p100-sxm2": "p100", "mi300": "mi300x",
           "a100-80gb-sxm": "a100-80gb", "a100-40gb-sxm": "a100-40gb", "h200-sxm": "h200", "h100-500w": "h100-sxm-500w", "h100-grand-teton": "h100-sxm-500w"}

def _L(name, bw, lat, kind, src, busbw=0.0, busbw_src=""):
    return Link(name, bw, lat, kind, src, busbw, busbw_src)


# Achievable rates (nccl-tests busbw, large messages; docs/plan.md "Link rates" lists them). NVLink loses
# ~20% to NCCL's protocol (S. Jeaugey, NVIDIA, nccl-tests issue #212: "450GB/s is the line rate. With the
# protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"); RDMA NICs keep ~96%.
NVLINK_SHARE = 0.8     # for NVLink generations without a published busbw: the ~20% protocol overhead above
RDMA_SHARE = 0.96      # for RDMA NICs without one: HDR 24/25 and NDR 48/50 (below)
_NV = "NCCL's ~20% NVLink protocol overhead (nccl-tests #212) applied to the line rate; no published busbw"
_RDMA = "0.96 of the line rate, as HDR and NDR measure (NVIDIA/nccl #812, nccl-tests #267); no published busbw"
LINKS: dict[str, Link] = {l.name: l for l in [
    _L("nvlink1", 80 * GB, 3e-6, "intra", "P100 SXM2: 4 links x 20 GB/s per direction (160 GB/s total)",
       NVLINK_SHARE * 80 * GB, _NV),
    _L("nvlink2", 150 * GB, 3e-6, "intra", "V100 SXM2: 6 links x 25 GB/s per direction",
       NVLINK_SHARE * 150 * GB, _NV),
    _L("nvlink3", 300 * GB, 3e-6, "intra", "A100: 12 links x 25 GB/s per direction (600 GB/s total)",
       232 * GB, "nccl-tests all_reduce_perf, 8 x A100 SXM in one node: 232.5 GB/s busbw (nccl-tests #175)"),
    _L("nvlink4", 450 * GB, 3e-6, "intra", "H100/H200: 18 links x 25 GB/s per direction (900 GB/s total)",
       370 * GB, "NCCL's effective NVLink 4 bandwidth, 370 GB/s busbw with the ring (S. Jeaugey, NVIDIA, "
       "nccl-tests #212)"),
    _L("nvlink5", 900 * GB, 3e-6, "intra", "B200/GB200: 18 links x 50 GB/s per direction (1.8 TB/s total)",
       NVLINK_SHARE * 900 * GB, _NV),
    _L("xgmi", 448 * GB, 3e-6, "intra", "MI300X Infinity Fabric: 7 links x 64 GB/s per direction (896 GB/s "
       "aggregate), one to each peer of the 8-GPU platform"),
    _L("pcie3", 15.75 * GB, 5e-6, "intra", "PCIe 3.0 x16, per direction"),
    _L("pcie4", 31.5 * GB, 5e-6, "intra", "PCIe 4.0 x16, per direction"),
    _L("pcie5", 63 * GB, 5e-6, "intra", "PCIe 5.0 x16, per direction"),
    _L("ib-edr", 100e9 / 8, 5e-6, "inter", "InfiniBand EDR 100 Gb/s",
       12.2 * GB, "12.2 GB/s busbw for a 100 Gb/s card, 'as good as you can get' (S. Jeaugey, nccl-tests #29)"),
    _L("ib-hdr", 200e9 / 8, 5e-6, "inter", "InfiniBand HDR 200 Gb/s",
       24 * GB, "DGX A100, 8 x HDR: 192 GB/s all-reduce busbw, 24 GB/s a NIC (NVIDIA, NVIDIA/nccl #812)"),
    _L("ib-ndr", 400e9 / 8, 5e-6, "inter", "InfiniBand NDR 400 Gb/s",
       48 * GB, "CX-7 at NDR 400 Gb/s: up to 48-49 GB/s a NIC (NVIDIA, nccl-tests #267)"),
    _L("ib-xdr", 800e9 / 8, 5e-6, "inter", "InfiniBand XDR 800 Gb/s", RDMA_SHARE * 100 * GB, _RDMA),
    _L("opa-100", 100e9 / 8, 5e-6, "inter", "Intel Omni-Path 100 Gb/s (OPA 100 series)"),
    # roce-25 and the TCP presets keep the line rate: no nccl-tests figure found; the reference case
    # worked by hand (ResNet-50 on 2 x 2 A100s: 33 ms at RoCE 25G, 82 ms at 10 GbE) reckons with it too
    _L("roce-25", 25e9 / 8, 8e-6, "inter", "RoCE v2 25 Gb/s"),
    _L("roce-100", 100e9 / 8, 8e-6, "inter", "RoCE v2 100 Gb/s", RDMA_SHARE * 12.5 * GB, _RDMA),
    _L("roce-200", 200e9 / 8, 8e-6, "inter", "RoCE v2 200 Gb/s", RDMA_SHARE * 25 * GB, _RDMA),
    _L("roce-400", 400e9 / 8, 8e-6, "inter", "RoCE v2 400 Gb/s",
       48 * GB, "CX-7 at 400 Gb/s on a RoCE cluster: up to 48-49 GB/s a NIC (NVIDIA, nccl-tests #267)"),
    _L("eth-10", 10e9 / 8, 30e-6, "inter", "10 GbE, TCP sockets"),
    _L("eth-25", 25e9 / 8, 30e-6, "inter", "25 GbE, TCP sockets"),
    _L("eth-50", 50e9 / 8, 30e-6, "inter", "50 GbE, TCP sockets"),
    _L("eth-100", 100e9 / 8, 30e-6, "inter", "100 GbE, TCP sockets"),
]}

LINK_ALIASES = {"10gbe": "eth-10", "25gbe": "eth-25", "100gbe": "eth-100", "hdr": "ib-hdr", "50gbe": "eth-50",
                "xdr": "ib-xdr", "omnipath": "opa-100", "opa": "opa-100", "infinity-fabric": "xgmi",
                "ndr": "ib-ndr", "edr": "ib-edr", "roce": "roce-25", "nvlink": "nvlink3"}


def _lookup(table: dict, aliases: dict, name: str, field_name: str, what: str):
    key = str(name).strip().lower()
    key = aliases.get(key, key)
    if key in table:
        return table[key]
    near = difflib.get_close_matches(key, list(table) + list(aliases), n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    raise ConfigError(f"unknown {what} '{name}'", field=field_name, value=name,
                      fix=f"{hint}known: {', '.join(table)}")


def get_gpu(name: str) -> GPU:
    return _lookup(GPUS, ALIASES, name, "gpu", "GPU")


def get_link(name: str, kind: str) -> Link:
    link = _lookup(LINKS, LINK_ALIASES, name, kind, "intra-node link" if kind == "intra" else "network")
    if link.kind != kind:
        known = ", ".join(n for n, l in LINKS.items() if l.kind == kind)
        raise ConfigError(f"'{name}' is an {link.kind}-node link, not an {kind}-node one",
                          field=kind, value=name, fix=f"use one of {known}")
    return link


# Each preset's architecture: what the per-architecture rules key on (terms/efficiency.py's table, the runtime's
# attention kernel, inputs/runtime.py)
GPU_ARCH = {"p100": "pascal", "v100-32gb": "volta", "a100-40gb": "ampere", "a100-80gb": "ampere",
            "a100-40gb-pcie": "ampere", "a100-80gb-pcie": "ampere", "l40s": "ada", "rtx4090": "ada", "l4": "ada",
            "h100-sxm": "hopper", "h100-sxm-500w": "hopper", "h100-pcie": "hopper", "h200": "hopper",
            "b200": "blackwell", "gb200": "blackwell", "mi300x": "cdna3"}


@dataclass
class Cluster:
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    nics_per_node: int = 1
    price_per_gpu_hour: float | None = None
    currency: str = "USD"                    # the unit of price_per_gpu_hour (--currency): printed with every cost
    efficiency_ref: str = "datasheet"        # "datasheet" (peak) or "calibration" (achieved)
    achieved_flops: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host_model: object = None                # tandem.plan.inputs.host_model.ModelCalibration from `bench train`, or None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def node_bandwidth_Bps(self) -> float:
        """All NICs of one node together, one direction."""
        return self.inter.bandwidth_Bps * self.nics_per_node

    @property
    def node_rate_Bps(self) -> float:
        """All NICs of one node together at their achievable rate (nccl-tests busbw), one direction."""
        return self.inter.rate_Bps * self.nics_per_node

    def flops_ref(self, precision: str) -> float:
        """The FLOP/s that `efficiency` multiplies: measured if calibrated, else datasheet peak."""
        if precision in self.achieved_flops:
            return self.achieved_flops[precision]
        return self.gpu.peak(precision)


def _positive_int(v, name: str) -> int:
    try:
        iv = int(v)
        ok = iv == float(v) and iv > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError("must be a positive integer", field=name, value=v, fix=f"give --{name} 1 or more")
    return iv


def make_cluster(gpu: str = "a100-80gb", gpus_per_node: int = 8, nodes: int = 1,
                 intra: str | None = None, inter: str = "ib-hdr", nics_per_node: int = 1,
                 price_per_gpu_hour: float | None = None) -> Cluster:
    g = get_gpu(gpu)
    gpn = _positive_int(gpus_per_node, "gpus-per-node")
    nn = _positive_int(nodes, "nodes")
    nics = _positive_int(nics_per_node, "nics-per-node")
    if price_per_gpu_hour is not None and price_per_gpu_hour < 0:
        raise ConfigError("must be >= 0", field="price", value=price_per_gpu_hour, fix="give a price per GPU-hour")
    return Cluster(g, gpn, nn, get_link(intra or g.intra_default, "intra"), get_link(inter, "inter"),
                   nics, price_per_gpu_hour)


CLUSTER_KEYS = {"gpu", "gpus_per_node", "nodes", "intra", "inter", "nics_per_node", "price_per_gpu_hour",
                "custom_gpu"}


def load_cluster_file(path: str | Path, **overrides) -> Cluster:
    """A YAML cluster file: the keys of ``make_cluster``; ``custom_gpu`` defines a GPU inline:
    ``{name, memory_gib, peak_tflops: {bf16: ..}, intra_default}``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("no such file", field="cluster", value=str(p), fix="give a YAML cluster file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse: {e}", field="cluster", value=str(p), fix="fix the YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping", field="cluster", value=str(p), fix="write key: value lines")
    unknown = set(data) - CLUSTER_KEYS
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}", field="cluster", value=str(p),
                          fix=f"valid keys: {', '.join(sorted(CLUSTER_KEYS))}")
    custom = data.pop("custom_gpu", None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    if custom:
        try:
            g = GPU(str(custom["name"]).lower(), float(custom["memory_gib"]) * GiB,
                    {k: float(v) * T for k, v in custom["peak_tflops"].items()},
                    str(custom.get("intra_default", "pcie4")), f"cluster file {p}")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad custom_gpu ({e})", field="cluster.custom_gpu", value=custom,
                              fix="give name, memory_gib, peak_tflops: {bf16: ...}") from None
        GPUS[g.name] = g
        data["gpu"] = g.name
    return make_cluster(**data)
