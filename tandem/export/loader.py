"""Loading an export: ``tandem.export.load(DIR)``, and `tandem export verify DIR`.

The model is built on the meta device from config.json (no memory, no initialisation), then
each parameter and buffer is set from the safetensors file(s): one ``nn.Parameter`` per stored
tensor, reused under every tied name, so tied weights are tied again. Only JSON and safetensors
are read: nothing on this path unpickles.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from tandem.core.errors import CheckpointError
from tandem.export import format as fmt
from tandem.export.stfile import tensor_bytes
from tandem.models.output import logits_of

FIELD = "export"


def read_config(folder: Path) -> dict:
    folder = Path(folder)
    path = folder / fmt.CONFIG
    if not path.is_file():
        raise CheckpointError("not an export folder (no config.json)", field=FIELD, value=str(folder),
                              fix="give a folder written by `tandem export`")
    cfg = json.loads(path.read_text())
    if cfg.get("format") != fmt.FORMAT or cfg.get("version") != fmt.VERSION:
        raise CheckpointError(f"unknown export format {cfg.get('format')!r} version {cfg.get('version')!r}",
                              field=FIELD, value=str(folder), fix=f"export again with this tandem ({fmt.FORMAT} "
                                                                  f"version {fmt.VERSION})")
    return cfg


def weight_files(folder: Path, tp_rank: int | None, cfg: dict) -> list[Path]:
    if tp_rank is not None:
        tp = cfg.get("tp", 1)
        if tp < 2 or not 0 <= tp_rank < tp:
            raise CheckpointError(f"tp_rank {tp_rank} is not among the export's {tp} tensor-parallel rank(s)",
                                  field="tp_rank", value=tp_rank,
                                  fix="export with --tp N and load a rank in 0..N-1, or tp_rank=None")
        return [folder / fmt.tp_folder(tp_rank, tp) / "model.safetensors"]
    index = folder / fmt.INDEX
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"]


def read_tensors(files: list[Path], device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f.name} is missing", field=FIELD, value=str(f.parent),
                                  fix="export again, or copy the whole export folder")
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod, _, attr = name.rpartition(".")
    return (model.get_submodule(mod) if mod else model), attr


def load(folder, device="cpu", tp_rank: int | None = None) -> nn.Module:
    """The exported model, in eval mode, on ``device``. With ``tp_rank`` (an export made with --tp N):
    the same module holding only that rank's slices (tp.py), for a tensor-parallel server to wire."""
    folder = Path(folder)
    cfg = read_config(folder)
    model = fmt.build_meta(cfg["model"])
    got = read_tensors(weight_files(folder, tp_rank, cfg), device)
    tied = cfg.get("tied", {})
    params: dict[str, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        canon = tied.get(name, name)
        if canon not in got:
            raise CheckpointError(f"{canon!r} is not in the export", field=FIELD, value=str(folder),
                                  fix="export again with this tandem")
        if canon not in params:
            params[canon] = nn.Parameter(got[canon], requires_grad=p.requires_grad)
        mod, attr = _owner(model, name)
        setattr(mod, attr, params[canon])
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        canon = tied.get(name, name)
        if canon in got:
            mod, attr = _owner(model, name)
            mod._buffers[attr] = got[canon]
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        _fill_unsaved_buffers(model, cfg, device)
    if tp_rank is None:
        shapes = cfg.get("tensors", {})
        for n, t in model.state_dict().items():
            if n in shapes and list(t.shape) != shapes[n]:
                raise CheckpointError(f"{n!r} is {list(t.shape)} in the export but {shapes[n]} in config.json",
                                      field=FIELD, value=str(folder), fix="export again")
    return model.eval()


def _fill_unsaved_buffers(model: nn.Module, cfg: dict, device) -> None:
    """Non-persistent buffers (not in a state dict, so not exported) come from a real build."""
    from tandem.core.spec import ModelSpec
    from tandem.models import build_model

    real = dict(build_model(ModelSpec(**cfg["model"])).named_buffers(remove_duplicate=False))
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        if b.is_meta:
            mod, attr = _owner(model, name)
            mod._buffers[attr] = real[name].to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{left[0]!r} has no value in the export", field=FIELD, value=cfg["model"]["name"],
                              fix="export again with this tandem")


def verify(folder) -> dict:
    """Every file's and every tensor's sha256 against manifest.json, then build and run one forward."""
    folder = Path(folder)
    read_config(folder)
    mpath = folder / fmt.MANIFEST
    if not mpath.is_file():
        raise CheckpointError("no manifest.json", field=FIELD, value=str(folder), fix="export again")
    man = json.loads(mpath.read_text())
    from tandem.train.manifest import sha256

    for rel, want in man["files"].items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"{rel} is missing", field=FIELD, value=str(folder), fix="export again")
        if p.stat().st_size != want["bytes"] or sha256(p) != want["sha256"]:
            raise CheckpointError(f"{rel} is altered: its size or sha256 differs from manifest.json", field=FIELD,
                                  value=str(folder), fix="export again")
    checked = _check_tensors(folder, man["tensors"], {n: t["file"] for n, t in man["tensors"].items()})
    for r in (man.get("tp") or {}).get("ranks", []):
        f = f"{r['folder']}/model.safetensors"
        checked += _check_tensors(folder, r["tensors"], {n: f for n in r["tensors"]})
    cfg = read_config(folder)
    y = run_example(load(folder), cfg["example_input"], folder)
    if not torch.isfinite(y.float()).all():
        raise CheckpointError("the model's forward gave non-finite outputs", field=FIELD, value=str(folder),
                              fix="check the training run (loss) and the export dtype")
    return {"export": str(folder), "files": len(man["files"]), "tensors": checked, "output_shape": list(y.shape),
            "step": man["provenance"]["step"], "dtype": man["dtype"]["export"]}


def run_example(model: nn.Module, desc: dict, folder: Path) -> torch.Tensor:
    """The model's output on the export's example input (on the model's device: the meta device checks
    shapes and dtypes without weights); a CheckpointError naming the input when the forward fails."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    x = fmt.make_input(desc).to(device)
    try:
        with torch.no_grad():
            return logits_of(model.eval()(x))
    except NotImplementedError:
        if device.type == "meta":
            raise  # an op without a meta kernel says nothing about the model: the caller skips the check
        raise CheckpointError(f"the model's forward is not implemented for the example input {desc['shape']}",
                              field=FIELD, value=str(folder), fix="check the model's factory") from None
    except Exception as e:
        raise CheckpointError(f"the model's forward failed on the example input {desc['shape']} {desc['dtype']} "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]})", field=FIELD,
                              value=str(folder),
                              fix="check the model's factory, or that the run's spec describes its input") from e


def _check_tensors(folder: Path, tensors: dict, file_of: dict) -> int:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n, f in file_of.items():
        by_file.setdefault(f, []).append(n)
    for f, names in sorted(by_file.items()):
        with safe_open(str(folder / f), framework="pt") as st:
            for n in names:
                if hashlib.sha256(tensor_bytes(st.get_tensor(n))).hexdigest() != tensors[n]["sha256"]:
                    raise CheckpointError(f"tensor {n!r} in {f} differs from its sha256 in manifest.json",
                                          field=FIELD, value=str(folder), fix="export again")
    return len(file_of)
