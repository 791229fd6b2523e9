"""Read a calibration file written by `tandem bench` and put its measurements in place of datasheets.

Schema ``tandem.calibration/1`` (JSON)::

    {"schema": "tandem.calibration/1", "created": ISO time, "host": str, "backend": "gloo"|"nccl",
     "device": "cpu"|"cuda", "world_size": int, "nnodes": int, "nproc_per_node": int, "hosts": [str, ...],
     "device_name": "cpu"|"NVIDIA A100-SXM4-80GB"|..., "device_memory_bytes": int, "cores": int,
     "links": {"intra_node": {"bandwidth_Bps": busbw, "latency_s": s,
                              "collectives": {"all_reduce": {"alpha_s", "beta_s_per_byte", "busbw_Bps"}, ...}},
               "inter_node": {... same; absent when measured on one node}},
     "compute": {"achieved_flops": {"fp32": FLOP/s, "bf16": FLOP/s, ...},
                 "model": {"name", "precision", "flops_per_sample", "achieved_flops", "threads_per_worker",
                           "cores", "background_threads", "step_samples_s": [s, ...], ...}}}   # bench train

Mapping (docs/plan.md, "Calibration"):
- intra_node: bus bandwidth B_intra = collectives.all_reduce.busbw_Bps if present, else bandwidth_Bps;
  latency alpha = latency_s (per ring step).
- latency_s is the fitted alpha of one all-reduce call; per ring step it is alpha / (2(n-1)), n = group_size.
- inter_node: the measured busbw is of an all-reduce over W ranks (group_size; `tandem bench` uses one
  rank per node, W = N, so B_node = busbw) on N nodes. The planner's
  hierarchical model gives that all-reduce 2(N-1)/N x S / B_node across nodes, nccl-tests's busbw is
  2(W-1)/W x S / t; equating the two (ignoring the intra-node phase) gives
  B_node = busbw x (N-1)/N x W/(W-1). That B_node replaces NICs x datasheet rate.
- the cluster: a calibration describes the cluster it measured (device, nodes, workers per node,
  one machine or several); `cluster_for` plans that cluster unless flags say otherwise, and refuses
  flags that contradict it (docs/plan.md, "Calibration").
- compute: achieved FLOP/s per precision replace the datasheet peak as the reference that the
  efficiency multiplies (default efficiency is then divided by 0.8, a GEMM's usual share of peak).

**The cluster a calibration describes** (``cluster_for``), and the flags that may (or may not) change it.

A calibration measures one cluster: a device kind (CPU workers, or a named GPU), N nodes of
G workers, its links. Its numbers mean something only for that kind of cluster, so
(docs/plan.md, "Calibration"):

- cluster inputs not given (flags, --cluster file, a job spec's nproc_per_node/nnodes) are
  taken from the calibration: the device (a CPU worker's memory is the host's RAM / workers),
  nodes, workers per node, and the measured links, named by what they are
  (``loopback/gloo (measured)``);
- --gpus-per-node and --nodes may differ (plan a larger cluster of the same kind): the measured
  link rates are reused and a note says so;
- a flag that contradicts a measurement is refused: --gpu of another device kind, --intra /
  --inter / --nics-per-node for a link the file measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from tandem.core.errors import ConfigError
from tandem.plan.inputs.hardware import GPU, GPUS, Cluster, Link, get_gpu, get_link
from tandem.plan.inputs.host_model import ModelCalibration

SCHEMA = "tandem.calibration/1"


def _num(d: dict, key: str, where: str) -> float:
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}.{key} must be a positive number", field="calibration", value=v,
                          fix="re-run `tandem bench` or correct the file")
    return float(v)


def read(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError:
        raise ConfigError("no such file", field="calibration", value=str(p),
                          fix="give a file written by `tandem bench`") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"not JSON ({e})", field="calibration", value=str(p),
                          fix="give a file written by `tandem bench`") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f"schema is {data.get('schema') if isinstance(data, dict) else None!r}, "
                          f"expected {SCHEMA!r}", field="calibration", value=str(p),
                          fix="re-run `tandem bench` with this version of tandem")
    return data


def _step_latency(link: dict, where: str) -> float:
    """The fit's alpha is per call; the planner's alpha is per ring step (2(n-1) steps per all-reduce)."""
    alpha = _num(link, "latency_s", where)
    n = int(link.get("group_size") or 2)
    return alpha / (2 * max(1, n - 1))


def _busbw(link: dict, where: str) -> float:
    ar = (link.get("collectives") or {}).get("all_reduce") or {}
    if isinstance(ar.get("busbw_Bps"), (int, float)) and ar["busbw_Bps"] > 0:
        return float(ar["busbw_Bps"])
    return _num(link, "bandwidth_Bps", where)


def _datasheet(link: Link, bw: float) -> str:
    """The datasheet number a measurement replaces; none when the link had none (a CPU cluster)."""
    return "" if link.name.endswith("(unused)") else f" (datasheet {bw / 1e9:.3g})"


def apply(c: Cluster, data: dict) -> Cluster:
    """The cluster with measured links and FLOP/s; notes say what was replaced."""
    notes = list(c.notes)
    links = data.get("links") or {}
    intra, inter = c.intra, c.inter
    nics = c.nics_per_node
    if "intra_node" in links:
        li = links["intra_node"]
        bw = _busbw(li, "links.intra_node")
        intra = Link(link_label(data, "intra"), bw, _step_latency(li, "links.intra_node"), "intra",
                     f"calibration {data.get('host', '?')}")
        notes.append(f"intra-node: {bw / 1e9:.3g} GB/s bus bandwidth measured"
                     + _datasheet(c.intra, c.intra.bandwidth_Bps))
    if "inter_node" in links:
        le = links["inter_node"]
        busbw = _busbw(le, "links.inter_node")
        w = int(le.get("group_size") or data.get("world_size") or 0)
        n = int(data.get("nnodes") or 0)
        if w < 2 or n < 2:
            raise ConfigError("inter_node needs world_size >= 2 and nnodes >= 2", field="calibration",
                              value=(w, n), fix="re-run `tandem bench` across at least two nodes")
        b_node = busbw * (n - 1) / n * w / (w - 1)
        inter = Link(link_label(data, "inter"), b_node, _step_latency(le, "links.inter_node"), "inter",
                     f"calibration {data.get('host', '?')}")
        nics = 1
        notes.append(f"inter-node: {busbw / 1e9:.3g} GB/s busbw over {w} ranks on {n} nodes -> "
                     f"{b_node / 1e9:.3g} GB/s per node" + _datasheet(c.inter, c.node_bandwidth_Bps))
    achieved = {}
    for k, v in ((data.get("compute") or {}).get("achieved_flops") or {}).items():
        if isinstance(v, (int, float)) and v > 0:
            achieved[str(k)] = float(v)
    if achieved:
        notes.append("compute: achieved FLOP/s " + ", ".join(f"{k} {v / 1e12:.3g} T" for k, v in achieved.items()))
    host_model = None
    entry = (data.get("compute") or {}).get("model")
    if isinstance(entry, dict) and "flops_per_sample" not in entry:
        notes.append("compute.model ignored: written by an older `tandem bench train` (no flops_per_sample); "
                     "re-run it to calibrate the model's FLOP/s")
    elif entry is not None:
        host_model = ModelCalibration.from_doc(data["compute"]["model"], str(data.get("device") or "cpu"))
        notes.append(f"compute: {host_model.name} ({host_model.precision}) measured at "
                     f"{host_model.achieved_flops / 1e9:.3g} GFLOP/s per worker on {host_model.threads} thread(s) "
                     f"of {host_model.cores} cores, {host_model.background:.1f} other runnable threads")
    return replace(c, intra=intra, inter=inter, nics_per_node=nics, achieved_flops=achieved,
                   efficiency_ref="calibration" if achieved else c.efficiency_ref, notes=notes,
                   host_model=host_model)


def load(path: str | Path, c: Cluster) -> Cluster:
    return apply(c, read(path))


def link_label(data: dict, kind: str) -> str:
    """What a measured link is: gloo between processes of one machine runs over loopback TCP;
    simulated nodes are processes of one machine too."""
    backend = data.get("backend") or "?"
    one_machine = len(set(data.get("hosts") or [])) == 1
    if kind == "intra":
        where = "loopback" if (data.get("device") or "cpu") == "cpu" else "intra-node"
    else:  # a file from before "hosts" does not say whether its nodes were simulated
        where = "inter-node" if not data.get("hosts") else "loopback" if one_machine else "network"
    return f"{where}/{backend} (measured)"


# ---- the cluster a calibration describes



CLUSTER_FLAGS = ("gpu", "gpus_per_node", "nodes", "intra", "inter", "nics_per_node")


def match_gpu(device_name: str) -> GPU | None:
    """The preset of a CUDA device name (torch.cuda.get_device_properties().name), if there is one."""
    n = device_name.lower().replace(" ", "-")
    pcie = "pcie" in n
    if "a100" in n:
        mem = "80gb" if "80" in n else "40gb"
        return GPUS[f"a100-{mem}" + ("-pcie" if pcie else "")]
    for key, preset in (("h200", "h200"), ("v100", "v100-32gb"), ("l40s", "l40s"), ("4090", "rtx4090")):
        if key in n:
            return GPUS[preset]
    if "h100" in n:
        return GPUS["h100-pcie" if pcie else "h100-sxm"]
    return None


def described(data: dict) -> str:
    nodes, gpn = int(data.get("nnodes") or 1), workers_per_node(data)
    dev = data.get("device_name") or data.get("device") or "?"
    machines = "1 machine" if len(set(data.get("hosts") or [])) == 1 and nodes > 1 else ""
    return (f"{nodes} node(s) x {gpn} {dev} worker(s), {data.get('backend', '?')}"
            + (f", simulated on {machines}" if machines else ""))


def workers_per_node(data: dict) -> int:
    n = data.get("nproc_per_node")
    if isinstance(n, int) and n > 0:
        return n
    return max(1, int(data.get("world_size") or 1) // max(1, int(data.get("nnodes") or 1)))


def device_gpu(data: dict, gpn: int, notes: list[str]) -> GPU:
    """The calibration's device as the planner's GPU record."""
    flops = {k: float(v) for k, v in ((data.get("compute") or {}).get("achieved_flops") or {}).items()
             if isinstance(v, (int, float)) and v > 0}
    mem = data.get("device_memory_bytes")
    if (data.get("device") or "cpu") == "cpu":
        if not flops:
            raise ConfigError("a CPU calibration without compute.achieved_flops has no FLOP/s to plan with",
                              field="calibration", value=data.get("host"),
                              fix="re-run `tandem bench comm` without --no-compute")
        if not isinstance(mem, (int, float)) or mem <= 0:  # a file from before device_memory_bytes
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            notes.append("host memory not in the calibration: this machine's RAM assumed")
        # workers of one node share its RAM; their "peak" is the matmul FLOP/s measured on one of them
        return GPU("cpu", float(mem) / gpn, flops, "loopback", f"calibration {data.get('host', '?')}")
    name = str(data.get("device_name") or "")
    preset = match_gpu(name) if name else None
    if preset is not None:
        return preset
    if not name or not flops or not isinstance(mem, (int, float)):
        raise ConfigError(f"the calibration does not say which GPU it measured ({name or 'no device_name'})",
                          field="gpu", value=name or None,
                          fix="give --gpu for the measured GPU, or re-run `tandem bench comm` with this tandem")
    return GPU(name.lower(), float(mem), flops, "pcie4", f"calibration {data.get('host', '?')} (measured FLOP/s)")


def cluster_for(path: str | Path, v: dict, given: set[str], file_cluster: Cluster | None) -> Cluster:
    """The cluster to plan with the calibration at `path`; `v` the plan's inputs, `given` the ones the
    user set (flags, cluster-file keys, job-spec launch shape); `file_cluster` from --cluster."""
    data = read(path)
    links = data.get("links") or {}
    dev = data.get("device") or "cpu"
    notes: list[str] = []
    cal_nodes, cal_gpn = int(data.get("nnodes") or 1), workers_per_node(data)
    gpn = v["gpus_per_node"] if "gpus_per_node" in given else cal_gpn
    nodes = v["nodes"] if "nodes" in given else cal_nodes
    gpu = device_gpu(data, gpn, notes) if dev == "cpu" or "gpu" not in given or data.get("device_name") else None
    if "gpu" in given:
        want = file_cluster.gpu if file_cluster is not None else get_gpu(v["gpu"])
        if gpu is None:  # an older GPU calibration that does not name its device: trust the flag
            gpu = want
            notes.append(f"the calibration does not name its GPU: {want.name} assumed")
        elif want.name != gpu.name:
            src = "--gpu" if file_cluster is None else "gpu from the --cluster file"
            raise ConfigError(f"{path} was measured on {described(data)}, not on {want.name}", field="gpu",
                              value=want.name, fix=f"drop {src} to plan the measured {gpu.name} cluster, or "
                                                   f"plan with a calibration measured on {want.name} GPUs "
                                                   "(`tandem bench comm --device cuda --calibration FILE` there)")
    for flag, link in (("intra", "intra_node"), ("inter", "inter_node"), ("nics_per_node", "inter_node")):
        if flag in given and link in links:
            opt = "--" + flag.replace("_", "-")
            raise ConfigError(f"{path} measured the {link.replace('_', '-')} link ({described(data)}); "
                              f"{opt} would contradict it", field=opt[2:], value=v[flag],
                              fix=f"drop {opt} (the measured link is used), or drop --calibration to plan "
                                  "on datasheet links")
    if (nodes, gpn) != (cal_nodes, cal_gpn):
        notes.append(f"measured on {cal_nodes} node(s) x {cal_gpn} worker(s), planning {nodes} x {gpn}: "
                     "the measured link rates are reused at this size")
    intra = _unmeasured(links, "intra_node", gpn > 1, v, given, gpu, dev, notes)
    inter = _unmeasured(links, "inter_node", nodes > 1, v, given, gpu, dev, notes)
    nics = v["nics_per_node"] if "nics_per_node" in given else 1
    c = Cluster(gpu, gpn, nodes, intra, inter, nics, v.get("price"), notes=notes)
    return apply(c, data)


def _unmeasured(links: dict, key: str, used: bool, v: dict, given: set[str], gpu: GPU, dev: str,
                notes: list[str]) -> Link:
    """The link `apply` will replace when measured; else a datasheet link (CPU clusters have none)."""
    kind = "intra" if key == "intra_node" else "inter"
    if key in links or not used:
        return Link(f"{kind} (unused)", 1.0, 0.0, kind)
    if kind in given:
        return get_link(v[kind], kind)
    if dev == "cpu":
        raise ConfigError(f"the calibration has no {key.replace('_', '-')} measurement and a plan on "
                          f"{'more workers per node' if kind == 'intra' else 'several nodes'} needs one",
                          field="calibration", value=key,
                          fix=(f"give --{kind} (a datasheet link), or measure it: tandem bench comm "
                               + ("--nproc-per-node 2" if kind == "intra" else "--simulate-nodes 2")
                               + " --calibration FILE"))
    name = gpu.intra_default if kind == "intra" else v["inter"]
    notes.append(f"{key.replace('_', '-')} not measured: datasheet {name} assumed")
    return get_link(name, kind)
