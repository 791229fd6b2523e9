"""Export: training checkpoints to deployable weights (safetensors + config.json + manifest.json).

    tandem export runs/gpt                     # -> runs/gpt/export/step-00000120/
    model = tandem.export.load("runs/gpt/export/step-00000120", device="cpu")
    tandem export runs/gpt --format hf         # -> runs/gpt/export/step-00000120-hf/ (transformers loads it)

This stage reads checkpoints (tandem/train/checkpoint.py's format) and writes export folders
(format.py); it imports no training loop. See docs/export.md.
"""

from __future__ import annotations


def load(folder, device="cpu", tp_rank=None):
    """The exported model in eval mode (see loader.load)."""
    from tandem.export.loader import load as _load

    return _load(folder, device=device, tp_rank=tp_rank)


def export(source, out=None, *, format: str = "tandem", dtype: str = "keep", tp: int = 1, shard_size: int = 4 << 30,
           force: bool = False, spec=None) -> dict:
    """`tandem export SOURCE [--format hf]` from Python: the summary the CLI prints."""
    from pathlib import Path

    from tandem.export.exporter import ExportOptions, export as _export

    o = ExportOptions(Path(source), Path(out) if out else None, dtype, tp, None, shard_size, force,
                      Path(spec) if spec else None, progress=False)
    if format == "hf":
        from tandem.export.hf import export_hf

        return export_hf(o)
    if format != "tandem":
        from tandem.core.errors import ConfigError

        raise ConfigError("unknown format", field="format", value=format, fix="use tandem or hf")
    return _export(o)


def verify(folder) -> dict:
    from tandem.export.hf import is_hf_export, verify_hf
    from tandem.export.loader import verify as _verify

    return (verify_hf if is_hf_export(folder) else _verify)(folder)


__all__ = ["load", "verify", "export"]
