"""`tandem export RUN_DIR|CHECKPOINT [options]` and `tandem export verify DIR`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tandem.core.errors import ConfigError
from tandem.core.units import parse_size


def _size(text: Optional[str], field: str) -> Optional[int]:
    return None if text is None else parse_size(text, field)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def export_cmd(
    source: str = typer.Argument(..., metavar="RUN_DIR|CHECKPOINT|verify",
                                 help="A run dir (its latest checkpoint), a checkpoint folder, or 'verify'."),
    folder: Optional[str] = typer.Argument(None, metavar="[DIR]", help="With 'verify': the export folder to check."),
    out: Optional[Path] = typer.Option(None, "--out", help="Export folder (default RUN_DIR/export/step-N)."),
    dtype: str = typer.Option("keep", "--dtype", help="keep | bf16 | fp16 | fp32 (floating-point tensors only)."),
    format: str = typer.Option("tandem", "--format", help="tandem (tandem.export.load, --tp slices) | hf (a "
                                                           "Hugging Face folder transformers, vLLM and SGLang load)."),
    tp: int = typer.Option(1, "--tp", help="Also write tp-R-of-N/ slices for N tensor-parallel ranks (gpt)."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory",
                                             help="Tensor bytes held at once, e.g. 2GiB (default: 2 x the "
                                                  "largest tensor)."),
    shard_size: str = typer.Option("4GiB", "--shard-size", help="Split the weights into files of at most this."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="The run's spec.json (when the checkpoint is not "
                                                              "inside its run dir)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Export a training checkpoint to safetensors + config.json + manifest.json, streamed in bounded memory.

    `tandem export verify DIR` rechecks every hash, builds the model and runs one forward.
    """
    if source == "verify" and folder is not None:
        return _verify(folder, as_json)
    if folder is not None:
        raise ConfigError("unexpected second argument", field="export", value=folder,
                          fix="give one RUN_DIR or CHECKPOINT, or `tandem export verify DIR`")
    from tandem.export.exporter import ExportOptions, export  # torch inside: `tandem --help` stays fast

    if format not in ("tandem", "hf"):
        raise ConfigError("unknown format", field="--format", value=format, fix="use tandem or hf")
    if format == "hf":
        from tandem.export.hf import export_hf as export
    opts = ExportOptions(Path(source), out, dtype, tp, _size(max_memory, "--max-memory"),
                         _size(shard_size, "--shard-size"), force, spec, progress=not as_json and sys.stderr.isatty())
    r = export(opts)
    if as_json:
        print(json.dumps(r, indent=1))
        return
    tied = ", ".join(f"{a} -> {c}" for a, c in r["tied"].items())
    print(f"exported step {r['step']} of {r['checkpoint']}\n  -> {r['out']}"
          + (f" ({r['architecture']}, Hugging Face format)" if r.get("format") == "hf" else ""))
    print(f"  {r['tensors']} tensors, {_mib(r['bytes'])} ({r['dtype']})" + (f"; tied: {tied}" if tied else ""))
    if r["dtype"] != "keep":
        print(f"  largest cast error {r['max_cast_error']:.3g}")
    print(f"  files: {', '.join(r['files'])}")
    if r.get("format") == "hf" and not r["tokenizer"]["hf"]:
        print(f"  no tokenizer: {r['tokenizer'].get('note', '')}")
    print(f"  peak memory {_mib(r['peak_rss_bytes'])} (largest tensor {_mib(r['largest_tensor_bytes'])}), "
          f"{r['seconds']:.2f} s")


def _verify(folder: str, as_json: bool) -> None:
    from tandem.export.hf import is_hf_export, verify_hf  # torch inside
    from tandem.export.loader import verify

    r = (verify_hf if is_hf_export(Path(folder)) else verify)(Path(folder))
    if as_json:
        print(json.dumps(r, indent=1))
        return
    print(f"ok: {r['export']}: {r['files']} files and {r['tensors']} tensors match manifest.json; "
          f"the model builds and its forward gives {r['output_shape']} ({r['dtype']}, step {r['step']})")
