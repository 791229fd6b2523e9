"""Export: training checkpoints to deployable weights (safetensors + config.json + manifest.json).

    tandem export runs/gpt                     # -> runs/gpt/export/step-00000120/
    model = tandem.export.load("runs/gpt/export/step-00000120", device="cpu")

This stage reads checkpoints (tandem/train/checkpoint.py's format) and writes export folders
(format.py); it imports no training loop. See docs/export.md.
"""

from __future__ import annotations


def load(folder, device="cpu", tp_rank=None):
    """The exported model in eval mode (see loader.load)."""
    from tandem.export.loader import load as _load

    return _load(folder, device=device, tp_rank=tp_rank)


def verify(folder) -> dict:
    from tandem.export.loader import verify as _verify

    return _verify(folder)


__all__ = ["load", "verify"]
