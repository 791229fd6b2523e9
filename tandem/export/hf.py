"""`tandem export RUN --format hf`: a training checkpoint as a Hugging Face folder, streamed.

    <out>/config.json                       transformers' config (model_type, architectures, the shape)
    <out>/generation_config.json            bos/eos/pad ids where the model has them
    <out>/model.safetensors                 Hugging Face tensor names (or model-0000K-of-0000N.safetensors
                                            above --shard-size, with model.safetensors.index.json)
    <out>/tokenizer.json, tokenizer_config.json   the run's tokenizer, where it has a Hugging Face one
    <out>/manifest.json                     bytes and sha256 of every file and tensor, provenance, tokenizer

``AutoModelForCausalLM.from_pretrained(out)`` loads it with no custom code, and vLLM / SGLang read the
same folder. The architecture is the one the model was imported as (``model.name = "hf:DIR"``), else
the one its options make (tandem/core/hf.py's ``for_model``): tandem's Llama as LlamaForCausalLM,
Qwen2ForCausalLM (qkv_bias) or Qwen3ForCausalLM (qk_norm), its mixture of experts (model.experts, no
shared experts) as MixtralForCausalLM (each expert's w1/w2/w3 a slice of tandem's stacked weights, as
transformers' save_pretrained writes them), tandem's GPT as GPT2LMHeadModel (grouped k/v heads repeated
into c_attn, linears transposed into Conv1D). Shared experts are refused: no Hugging Face class computes
them as tandem does (tandem/core/hf.py's ``for_model`` says why). One Hugging Face tensor at a time:
its tandem tensor(s) read from the checkpoint (DCP), transformed, cast, hashed, written and dropped; a
stacked expert weight is read once and kept until its last expert is written (file order is by name,
so one block's w1, w2 and w3 stacks are held together: at most 3 stacks besides the tensor written).
Tensor-parallel slices (``--tp``) stay tandem's own format.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import torch

from tandem.core import hf as adapters
from tandem.core.errors import CheckpointError, ConfigError
from tandem.export import format as fmt
from tandem.export.exporter import (DTYPES, ExportOptions, _cast, _clean, _mkdirs, _nbytes, _out_dtype, _publish,
                                    _shards, check_options, default_out, provenance, shard_names)
from tandem.export.source import FIELD, ExportIOError, open_source
from tandem.export.stfile import Entry, StreamFile, order
from tandem.models.hf import to_hf

FORMAT = "tandem-export-hf"
TORCH_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_dict(model: torch.nn.Module, m: dict) -> dict:
    """The spec's [model] with the sizes its zeros stand for (ffn, head_dim, kv_heads), as the model built them."""
    c = model.config
    out = {**m, "ffn": c.ffn, "kv_heads": c.kv_heads}
    if m["name"] == "llama":
        out.update(head_dim=c.head_dim, rope_scaling=dict(c.rope_scaling))
    return out


def hf_config(m: dict, arch, dtype: torch.dtype) -> dict:
    """config.json: the keys carried from the imported checkpoint, then tandem's (which win)."""
    carried = dict((m.get("hf") or {}).get("config") or {})
    cfg = {**carried, **arch.config(m), "torch_dtype": TORCH_DTYPE.get(dtype, "float32")}
    if arch.kind == "llama" and carried.get("max_position_embeddings", 0) > m["seq"]:
        cfg["max_position_embeddings"] = carried["max_position_embeddings"]   # fine-tuned on shorter windows
    return cfg


def export_hf(o: ExportOptions) -> dict:
    t0 = time.perf_counter()
    check_options(o)
    if o.tp != 1:
        raise ConfigError("tensor-parallel slices are tandem's own format; a Hugging Face folder holds whole "
                          "tensors (a tp server shards them itself)", field="--tp", value=o.tp,
                          fix="export --format hf without --tp, or --tp N without --format hf")
    src = open_source(o.source, o.spec)
    out = Path(o.out) if o.out else default_out(src).with_name(default_out(src).name + "-hf")
    if out.exists() and not o.force:
        raise ConfigError("the output folder exists", field="--out", value=str(out),
                          fix="give another --out, or --force to replace it")
    model = fmt.build_meta(src.spec["model"])
    names, tied = fmt.match_model(model, src)
    m = model_dict(model, src.spec["model"])
    arch = adapters.for_model(m)
    rules = arch.rules(m)
    covered = {n for r in rules for n in r.tandem}
    left = [n for n in names if n not in covered]
    if left:
        raise CheckpointError(f"{left[0]} has no place in {arch.architecture}", field="--format", value="hf",
                              fix="export this run in tandem's format")
    target = DTYPES[o.dtype]
    dtype_of = {r.hf: _out_dtype(src.tensors[r.tandem[0]][0], target) for r in rules}
    entries = [Entry(r.hf, dtype_of[r.hf], r.shape) for r in rules]
    largest = max(e.nbytes for e in entries)
    # stacked expert weights held while their experts are written (_write): up to 3 at once (w1, w2, w3), and
    # a 4th while DCP reads the next (its read buffer and the tensor: measured, docs/export.md)
    stacked = sorted({math.prod(src.tensors[n][1]) * src.tensors[n][0].itemsize
                      for r in rules if r.op == "expert" for n in r.tandem})
    held = 4 * stacked[-1] if stacked else 0
    shards = _shards(order(entries), o.shard_size)
    made = _mkdirs(out.parent)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        record = _write(src, tmp, shards, {r.hf: r for r in rules}, m, target, o)
        files = record["files"]
        out_dtype = next(iter(dtype_of.values()))
        cfg = hf_config(m, arch, out_dtype)
        files["config.json"] = fmt.write_json(tmp / "config.json", cfg)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        files["generation_config.json"] = fmt.write_json(tmp / "generation_config.json", gen)
        tok, tok_files = carry_tokenizer(src.spec, m, tmp)
        files.update(tok_files)
        man = {"format": FORMAT, "version": fmt.VERSION, "architecture": arch.architecture,
               "files": dict(sorted(files.items())), "tensors": dict(sorted(record["tensors"].items())),
               "dtype": {"export": o.dtype, "source": sorted({fmt.dtype_name(src.tensors[n][0]) for n in names}),
                         "max_cast_error": record["max_cast_error"]},
               "tokenizer": tok, "provenance": provenance(src)}
        fmt.write_json(tmp / fmt.MANIFEST, man)
        _check(tmp, out, rules, sum(e.nbytes for e in entries))
        _publish(tmp, out, o.force)
    except OSError as e:
        _clean(tmp, made)
        raise ExportIOError(f"writing the export failed ({type(e).__name__}: {e})", field="--out", value=str(out),
                            fix="free space or fix permissions there, then export again") from e
    except BaseException:
        _clean(tmp, made)
        raise
    total = sum(v["bytes"] for k, v in files.items() if k.endswith(".safetensors"))
    return {"out": str(out), "checkpoint": str(src.path), "step": src.step, "tensors": len(entries),
            "tied": tied, "bytes": total, "files": sorted([*files, fmt.MANIFEST]), "dtype": o.dtype,
            "max_cast_error": record["max_cast_error"], "tp": 1, "format": "hf",
            "architecture": arch.architecture, "tokenizer": tok, "seconds": time.perf_counter() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "largest_tensor_bytes": largest, "memory_budget_bytes": 4 * largest + held}


def _write(src, tmp: Path, shards: list[list[Entry]], rules: dict, m: dict, target, o: ExportOptions) -> dict:
    """Each Hugging Face tensor in file order: its tandem tensors read (a fused q/k/v: three), made, cast,
    written. Held at once: the parts and the result, under 4 x the largest tensor."""
    from tandem.export.progress import bar

    files = shard_names(len(shards))
    meta = {"format": "pt", "producer": "tandem export --format hf"}
    writers = [StreamFile(tmp / f, s, meta) for f, s in zip(files, shards)]
    head_dim = m.get("head_dim") or m["hidden"] // m["heads"]
    tensors, worst = {}, 0.0
    # a stacked expert weight (experts HF tensors): read once, kept until its last expert is written
    uses: dict[str, int] = {}
    for r in rules.values():
        if r.op == "expert":
            uses[r.tandem[0]] = uses.get(r.tandem[0], 0) + 1
    stacks: dict[str, torch.Tensor] = {}
    try:
        with bar(sum(e.nbytes for s in shards for e in s), o.progress) as advance:
            for k, (w, shard) in enumerate(zip(writers, shards)):
                for e in w.entries:
                    rule = rules[e.name]
                    if rule.op == "expert":
                        name = rule.tandem[0]
                        if name not in stacks:
                            stacks[name] = src.read([name])[name]
                        t = to_hf(rule, [stacks[name]], head_dim)
                        uses[name] -= 1
                        if not uses[name]:
                            del stacks[name]
                    else:
                        got = src.read(list(rule.tandem))
                        t = to_hf(rule, [got.pop(n) for n in rule.tandem], head_dim)
                        del got
                    out_t, err = _cast(t, target)
                    if not math.isfinite(err):
                        raise ConfigError(f"{e.name} does not fit in {o.dtype}: casting gives non-finite values",
                                          field="--dtype", value=o.dtype, fix="export with --dtype bf16, fp32 or keep")
                    del t
                    tensors[e.name] = {"dtype": fmt.dtype_name(out_t.dtype), "shape": list(out_t.shape),
                                       "file": files[k], "sha256": w.write(e.name, out_t), "from": list(rule.tandem),
                                       "max_cast_error": err}
                    worst = max(worst, err)
                    advance(e.nbytes)
                    del out_t
        done = {f: w.close() for f, w in zip(files, writers)}
    except BaseException:
        for w in writers:
            w.abort()
        raise
    if len(files) > 1:
        done[fmt.INDEX] = fmt.write_json(tmp / fmt.INDEX, {
            "metadata": {"total_size": sum(done[f]["bytes"] for f in files)},
            "weight_map": {n: t["file"] for n, t in sorted(tensors.items())}})
    return {"files": done, "tensors": tensors, "max_cast_error": worst}


def carry_tokenizer(spec: dict, m: dict, tmp: Path) -> tuple[dict, dict]:
    """(the manifest's tokenizer record, files written). The run's token folder's tokenizer.json (tandem data
    prepare-text) with a tokenizer_config.json for transformers' PreTrainedTokenizerFast; a byte-level folder
    has no Hugging Face tokenizer (said so); a run on another data set carries the imported checkpoint's."""
    data = spec.get("data", {})
    written: dict = {}
    if data.get("name") == "tokens" and data.get("path"):
        folder = Path(data["path"])
        try:
            man = json.loads((folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {"kind": "unknown", "hf": False, "note": f"token folder {folder} is not readable here"}, written
        kind = man.get("tokenizer", {}).get("kind", "byte")
        name = man.get("tokenizer", {}).get("file") or "tokenizer.json"
        if not (folder / name).is_file():
            return {"kind": kind, "hf": False, "source": str(folder),
                    "note": "byte-level ids (0-255, one per UTF-8 byte): no Hugging Face tokenizer; "
                            "text = bytes(ids).decode('utf-8')" if kind == "byte" else
                    f"{name} is not in the token folder"}, written
        return {"kind": kind, "hf": True, "source": str(folder)}, _copy_tokenizer(folder, name, m, tmp)
    base = Path((m.get("hf") or {}).get("path") or "")
    if str(base) and (base / "tokenizer.json").is_file():
        return {"kind": "hf", "hf": True, "source": str(base)}, _copy_tokenizer(base, "tokenizer.json", m, tmp)
    return {"kind": data.get("name", "none"), "hf": False,
            "note": f"data.name = {data.get('name')!r} has no tokenizer: ids are the task's own"}, written


def _copy_tokenizer(folder: Path, name: str, m: dict, tmp: Path) -> dict:
    from tandem.train.manifest import sha256

    files = {}
    shutil.copyfile(folder / name, tmp / "tokenizer.json")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):   # a chat template only where there is one
        if (folder / extra).is_file():
            shutil.copyfile(folder / extra, tmp / extra)
    tc = folder / "tokenizer_config.json"
    cfg = json.loads(tc.read_text()) if tc.is_file() else {}
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    cfg.setdefault("model_max_length", m["seq"])
    cfg.setdefault("clean_up_tokenization_spaces", False)
    fmt.write_json(tmp / "tokenizer_config.json", cfg)
    for f in TOKENIZER_FILES:
        if (tmp / f).is_file():
            files[f] = {"bytes": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
    return files


def _check(tmp: Path, out: Path, rules: list, total: int) -> None:
    """Before publishing: every header holds the shapes the config implies, and (up to 64 MiB) tandem's own
    import of the folder (model.name = 'hf:DIR') builds and gives finite logits."""
    try:
        adapters.check_folder(tmp, rules)
        if total <= 64 << 20:
            from tandem.models import hf as hf_models

            model = hf_models.load(tmp)
            x = torch.zeros(1, min(8, model.config.seq), dtype=torch.long)
            with torch.no_grad():
                y = model(x)
            if not torch.isfinite(y).all():
                raise CheckpointError("the exported model gives non-finite logits", field=FIELD, value=str(out),
                                      fix="check the training run (loss) and the export dtype")
    except ConfigError as e:
        raise CheckpointError(f"the Hugging Face folder does not load back ({e.message}); nothing was written",
                              field=FIELD, value=str(out), fix="report this: the adapter and the checkpoint disagree") \
            from None


def is_hf_export(folder: Path) -> bool:
    try:
        return json.loads((Path(folder) / fmt.MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def verify_hf(folder) -> dict:
    """`tandem export verify DIR` of a --format hf folder: every file's and tensor's sha256 against
    manifest.json, then tandem's own import of it (model.name = 'hf:DIR') and one forward."""
    from safetensors import safe_open

    from tandem.export.stfile import tensor_bytes
    from tandem.models import hf as hf_models
    from tandem.train.manifest import sha256

    folder = Path(folder)
    man = json.loads((folder / fmt.MANIFEST).read_text())
    for rel, want in man["files"].items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"{rel} is missing", field="export", value=str(folder), fix="export again")
        if p.stat().st_size != want["bytes"] or sha256(p) != want["sha256"]:
            raise CheckpointError(f"{rel} is altered: its size or sha256 differs from manifest.json", field="export",
                                  value=str(folder), fix="export again")
    for n, t in man["tensors"].items():
        with safe_open(str(folder / t["file"]), framework="pt") as st:
            if hashlib.sha256(tensor_bytes(st.get_tensor(n))).hexdigest() != t["sha256"]:
                raise CheckpointError(f"tensor {n!r} in {t['file']} differs from its sha256 in manifest.json",
                                      field="export", value=str(folder), fix="export again")
    model = hf_models.load(folder)
    x = fmt.make_input({"shape": [1, model.config.seq], "dtype": "int64", "kind": "tokens",
                        "high": model.config.vocab})
    with torch.no_grad():
        y = model(x)
    if not torch.isfinite(y).all():
        raise CheckpointError("the model's forward gave non-finite outputs", field="export", value=str(folder),
                              fix="check the training run (loss) and the export dtype")
    return {"export": str(folder), "files": len(man["files"]), "tensors": len(man["tensors"]),
            "output_shape": list(y.shape), "step": man["provenance"]["step"], "dtype": man["dtype"]["export"],
            "architecture": man["architecture"]}
