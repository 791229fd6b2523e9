"""`tandem export`: a training checkpoint to safetensors + config.json + manifest.json, streamed.

Order of work (each step can refuse with one line, before anything is written):
1. options (dtype, tp degree, memory budget), then the checkpoint (found, sha256 manifest verified);
2. the model rebuilt on the meta device from the run's spec: its names, shapes and tied parameters
   must match DCP's metadata; tied parameters must hold equal values in the checkpoint;
3. every output file's header laid out from the shapes alone (stfile.py);
4. tensors read from DCP in groups of at most the memory budget, each cast, hashed and written
   straight into its file(s) (and its tp slices), then dropped;
5. index, config.json, manifest.json; the folder, written as ``.tmp-export-*`` next to the
   destination, is renamed into place (a killed export leaves no half folder under the name).
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.errors import CheckpointError, ConfigError
from tandem.export import format as fmt
from tandem.export import tp as tpplan
from tandem.export.source import FIELD, ExportIOError, Source, manifest_sha256, open_source, spec_sha256
from tandem.export.stfile import Entry, StreamFile, order
from tandem.core import rundir

DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_GROUP = 16 << 20   # small tensors are read together up to this many bytes (fewer dcp.load calls)


@dataclass
class ExportOptions:
    source: Path
    out: Path | None = None
    dtype: str = "keep"
    tp: int = 1
    max_memory: int | None = None      # bytes of tensors held at once; None: 2 x the largest tensor
    shard_size: int = 4 << 30          # split model.safetensors into model-0000K-of-0000N above this
    force: bool = False
    spec: Path | None = None
    progress: bool = True


def default_out(src: Source) -> Path:
    base = src.run_dir if src.run_dir is not None else src.path.parent
    return base / rundir.EXPORT / src.path.name


def check_options(o: ExportOptions) -> None:
    if o.dtype not in DTYPES:
        raise ConfigError("unknown dtype", field="--dtype", value=o.dtype, fix="use keep | bf16 | fp16 | fp32")
    if o.shard_size < 1:
        raise ConfigError("must be positive", field="--shard-size", value=o.shard_size, fix="give a size like 4GiB")


def export(o: ExportOptions) -> dict:
    """Export and publish; returns the summary printed by the CLI (and its --json)."""
    t0 = time.perf_counter()
    check_options(o)
    src = open_source(o.source, o.spec)
    tpplan.check_degree(src.spec["model"], o.tp)
    out = Path(o.out) if o.out else default_out(src)
    if out.exists() and not o.force:
        raise ConfigError("the output folder exists", field="--out", value=str(out),
                          fix="give another --out, or --force to replace it")
    model = fmt.build_meta(src.spec["model"])
    names, tied = fmt.match_model(model, src)
    target = DTYPES[o.dtype]
    entries = [Entry(n, _out_dtype(src.tensors[n][0], target), src.tensors[n][1]) for n in names]
    largest = max(_nbytes(*src.tensors[n]) for n in names)
    budget = o.max_memory if o.max_memory is not None else 2 * largest
    if budget < 2 * largest:
        raise ConfigError(f"the largest tensor takes {largest} bytes; reading and casting it needs twice that",
                          field="--max-memory", value=o.max_memory, fix=f"give at least {2 * largest} bytes")
    _check_tied(src, tied, budget)
    shards = _shards(order(entries), o.shard_size)
    made = _mkdirs(out.parent)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        record = _write(src, tmp, shards, target, o, budget)
        files = record.pop("files")
        config = fmt.config(src, o.dtype, tied, {e.name: list(e.shape) for e in entries}, o.tp)
        files["config.json"] = fmt.write_json(tmp / "config.json", config)
        prov = provenance(src)
        fmt.write_json(tmp / fmt.MANIFEST, fmt.manifest(files, record["tensors"], tied, o.dtype, record, prov, o.tp,
                                                        record.get("tp_ranks")))
        _check_export(tmp, out, model, config, sum(_nbytes(*src.tensors[n]) for n in names), budget)
        _publish(tmp, out, o.force)
    except OSError as e:
        _clean(tmp, made)
        raise ExportIOError(f"writing the export failed ({type(e).__name__}: {e})", field="--out", value=str(out),
                            fix="free space or fix permissions there, then export again") from e
    except BaseException:
        _clean(tmp, made)
        raise
    total = sum(v["bytes"] for k, v in files.items() if k.endswith(".safetensors") and "/" not in k)
    return {"out": str(out), "checkpoint": str(src.path), "step": src.step, "tensors": len(entries),
            "tied": tied, "bytes": total, "files": sorted([*files, fmt.MANIFEST]), "dtype": o.dtype,
            "max_cast_error": record["max_cast_error"], "tp": o.tp, "seconds": time.perf_counter() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "largest_tensor_bytes": largest, "memory_budget_bytes": budget}


def _mkdirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, deepest first."""
    made = []
    p = folder
    while not p.exists():
        made.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return made


def _clean(tmp: Path, made: list[Path]) -> None:
    """After a failure: the temporary folder and any parent folder this export created."""
    shutil.rmtree(tmp, ignore_errors=True)
    for p in made:
        try:
            p.rmdir()
        except OSError:
            break


def _nbytes(dtype: torch.dtype, shape) -> int:
    return Entry("", dtype, tuple(shape)).nbytes


def _out_dtype(src: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """Casts touch floating-point tensors only: integer buffers (BatchNorm's counters) keep their type."""
    return target if target is not None and src.is_floating_point else src


def _check_tied(src: Source, tied: dict[str, str], budget: int) -> None:
    """A model that says tied must hold one value: refuse a checkpoint whose copies differ."""
    for alias, canon in sorted(tied.items()):
        if alias not in src.tensors:
            continue  # stored once already
        got = src.read([canon, alias])
        a, b = got[canon], got[alias]
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            raise CheckpointError(f"the model ties {alias} to {canon} but the checkpoint holds different values "
                                  f"(max abs difference {diff})", field=FIELD, value=str(src.path),
                                  fix="export with the spec the run was trained with (model.tied)")


def _shards(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Contiguous runs of the file order, each under ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def _groups(names: list[str], src: Source, budget: int, explicit: bool) -> list[list[str]]:
    """Consecutive names read by one dcp.load. Held at once: the group, plus one tensor as torch.load
    reads it or as it is cast. By default a group is one large tensor (or small ones up to 16 MiB): peak
    2 x the largest tensor. With --max-memory M, groups of up to M/2 (M >= 2 x the largest): fewer reads."""
    cap = budget // 2 if explicit else max(MIN_GROUP, max(_nbytes(*src.tensors[n]) for n in names))
    groups, size = [[]], 0
    for n in names:
        b = _nbytes(*src.tensors[n])
        if groups[-1] and size + b > cap:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    return groups


def _write(src: Source, tmp: Path, shards: list[list[Entry]], target, o: ExportOptions, budget: int) -> dict:
    meta = {"format": "pt", "producer": "tandem export"}
    files = shard_names(len(shards))
    all_entries = [e for s in shards for e in s]
    writers = [StreamFile(tmp / f, s, meta) for f, s in zip(files, shards)]
    where = {e.name: k for k, s in enumerate(shards) for e in s}
    tp_writers, tp_dims = [], {e.name: tpplan.shard_dim(e.name) for e in all_entries}
    if o.tp > 1:
        for r in range(o.tp):
            d = tmp / fmt.tp_folder(r, o.tp)
            d.mkdir()
            tp_writers.append(StreamFile(d / "model.safetensors",
                                         [Entry(e.name, e.dtype, tpplan.slice_shape(e.shape, tp_dims[e.name], o.tp, r))
                                          for e in all_entries], {**meta, "tp_rank": str(r), "tp": str(o.tp)}))
    tensors: dict[str, dict] = {}
    tp_tensors: list[dict] = [{} for _ in tp_writers]
    worst = 0.0
    from tandem.export.progress import bar

    names = [e.name for e in all_entries]
    try:
        with bar(sum(e.nbytes for e in all_entries), o.progress) as advance:
            for group in _groups(names, src, budget, o.max_memory is not None):
                got = src.read(group)
                for n in group:
                    t = got.pop(n)
                    out_t, err = _cast(t, target)
                    if not math.isfinite(err):
                        raise ConfigError(f"{n} does not fit in {o.dtype}: casting gives non-finite values "
                                          f"(largest |value| {t.abs().max().item():.4g})", field="--dtype",
                                          value=o.dtype, fix="export with --dtype bf16, fp32 or keep")
                    del t
                    k = where[n]
                    sha = writers[k].write(n, out_t)
                    tensors[n] = {"dtype": fmt.dtype_name(out_t.dtype), "shape": list(out_t.shape),
                                  "file": files[k], "sha256": sha, "source_dtype": fmt.dtype_name(src.tensors[n][0]),
                                  "max_cast_error": err}
                    worst = max(worst, err)
                    for r, w in enumerate(tp_writers):
                        piece = tpplan.cut(out_t, tp_dims[n], o.tp, r)
                        tp_tensors[r][n] = {"shape": list(piece.shape), "dim": tp_dims[n],
                                            "sha256": w.write(n, piece)}
                        del piece
                    advance(out_t.numel() * out_t.element_size())
                    del out_t
                del got
        done = {f: w.close() for f, w in zip(files, writers)}
        for r, w in enumerate(tp_writers):
            done[f"{fmt.tp_folder(r, o.tp)}/model.safetensors"] = w.close()
    except BaseException:
        for w in writers + tp_writers:
            w.abort()
        raise
    if len(files) > 1:
        done[fmt.INDEX] = fmt.write_json(tmp / fmt.INDEX, {
            "metadata": {"total_size": sum(done[f]["bytes"] for f in files)},
            "weight_map": {n: files[where[n]] for n in sorted(names)}})
    return {"files": done, "tensors": tensors, "max_cast_error": worst,
            "tp_ranks": tp_tensors if tp_writers else None}


def _cast(t: torch.Tensor, target: torch.dtype | None, chunk: int = 1 << 22) -> tuple[torch.Tensor, float]:
    """The tensor in the export dtype and the largest |cast - original| (exact: float64, in chunks)."""
    if target is None or not t.is_floating_point() or t.dtype == target:
        return t, 0.0
    out = t.to(target)
    flat_in, flat_out, worst = t.reshape(-1), out.reshape(-1), 0.0
    for i in range(0, flat_in.numel(), chunk):
        d = (flat_out[i:i + chunk].double() - flat_in[i:i + chunk].double()).abs().max().item()
        worst = max(worst, d)
    return out, worst


def provenance(src: Source) -> dict:
    """Where the weights come from. Times are the checkpoint's (deterministic: a second export of the same
    checkpoint is byte-identical, this file included)."""
    from tandem.train import manifest

    mpath = src.path / manifest.NAME
    stamp = (mpath if mpath.is_file() else src.path / "meta.json").stat().st_mtime
    return {"run_dir": str(src.run_dir.resolve()) if src.run_dir else None, "checkpoint": str(src.path.resolve()),
            "step": src.step, "checkpoint_manifest_sha256": manifest_sha256(src), "spec_sha256": spec_sha256(src),
            "layout": src.meta.parallel or {"strategy": "ddp", "tp": 1, "pp": 1},
            "world_size": src.meta.world_size, "job": src.meta.job,
            "torch_version": torch.__version__,
            "checkpoint_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))}


def _check_export(tmp: Path, out: Path, model: torch.nn.Module, config: dict, total: int, budget: int) -> None:
    """Refuse, before publishing, a folder `tandem export verify` would refuse. Up to the memory budget
    (or 64 MiB) that is verify itself on the temporary folder; above it, the forward on the example input
    runs on the meta-device model (shapes and dtypes, no weights loaded: the export's memory bound holds)."""
    from tandem.export.loader import run_example, verify

    try:
        if total <= max(budget, 64 << 20):
            verify(tmp)
        else:
            run_example(model, config["example_input"], tmp)
    except NotImplementedError:
        pass  # an op with no meta kernel: verify runs it for real
    except CheckpointError as e:
        raise CheckpointError(e.message + "; nothing was written", field=FIELD, value=str(out), fix=e.fix) from None


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename into place; with --force the old folder is moved aside first and deleted after."""
    old = None
    if out.exists():
        if not force:
            raise ConfigError("the output folder exists", field="--out", value=str(out),
                              fix="give another --out, or --force to replace it")
        old = out.parent / f".tmp-replaced-{out.name}-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
