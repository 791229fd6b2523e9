"""What a model's forward returned, as the tensor of scores the rest of tandem reads.

tandem's own models return their logits; a user's factory may return a Hugging Face output object
(``.logits``, as ``transformers`` models do), a dict with ``"logits"``, or a tuple whose first item is
the scores. One place decides, for the held-out evaluation, the export's verify and the loss."""

from __future__ import annotations

import torch


def logits_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:  # Hugging Face's ModelOutput is a dict too
        return out["logits"]
    if not isinstance(out, dict) and hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    raise TypeError(f"the model returned {type(out).__name__} and no logits: return a tensor of scores, or an "
                    "object or dict with logits")
