"""The cluster a calibration file describes, and the flags that may (or may not) change it.

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

import os
from pathlib import Path

from tandem.core.errors import ConfigError
from tandem.plan import calibration
from tandem.plan.hardware import GPU, GPUS, Cluster, Link, get_gpu, get_link

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
    data = calibration.read(path)
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
    return calibration.apply(c, data)


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
