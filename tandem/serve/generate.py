"""``tandem generate RUN_DIR|CHECKPOINT|EXPORT --prompt TEXT``: sample text from a trained language model.

The weights come as ``tandem export`` reads them: a run dir (its newest checkpoint) or a checkpoint
folder, its tensors assembled by DCP from whatever layout saved them (ddp, zero3, tp, pp), or an
export folder (tandem.export.load). The tokenizer is the token folder's (tandem data prepare-text
wrote it, tandem.data.text.Codec reads it back): the run's ``data.path`` (for an export folder inside
its run dir too) unless ``--data DIR`` says otherwise. Sampling is plain: the logits of the last
position over the model's last ``seq`` tokens, divided by the temperature (0: the most likely token),
one token at a time, from a torch.Generator seeded by ``--seed``.

Decoding uses the KV cache of tandem's decoders (``model.forward_cached``, tandem/models/kvcache.py, the
forward ``tandem serve`` decodes with): the prompt is run once, then each new token is one cached step,
while the text fits the model's ``seq`` positions. Past them the window of the last ``seq`` tokens
slides, every position changes, and each token is a whole forward over that window, as for a model
without the cached forward (a user factory's). Both give the same tokens (tests/serve/test_generate_cached.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.errors import ConfigError, DataError
from tandem.core.spec import ModelSpec
from tandem.data.text import Codec
from tandem.export import load
from tandem.export.format import tied_names
from tandem.export.source import open_source
from tandem.models import build_model
from tandem.models.kvcache import KVCache, model_positions, step_mask, supports


@dataclass
class Loaded:
    model: torch.nn.Module
    seq: int
    data_path: str     # the run's data.path ('' when unknown)
    source: str        # what the weights were read from


def load_model(path: Path) -> Loaded:
    path = Path(path)
    if (path / "config.json").is_file() and not (path / "spec.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        run_spec = path.parent.parent / "spec.json"  # tandem export's default place: RUN_DIR/export/step-N
        data = json.loads(run_spec.read_text()).get("data", {}).get("path", "") if run_spec.is_file() else ""
        return Loaded(load(path), int(cfg["model"].get("seq", 0)), data, str(path))
    src = open_source(path)
    torch.manual_seed(0)
    model = build_model(ModelSpec(**src.spec["model"]))
    tied = tied_names(model)
    names = [n for n in model.state_dict() if n not in tied and n in src.tensors]
    missing = [n for n in model.state_dict() if n not in tied and n not in src.tensors]
    if missing:
        raise ConfigError(f"the checkpoint has no {missing[0]!r}", field="RUN_DIR", value=str(path),
                          fix="give a checkpoint of this run's model")
    model.load_state_dict(src.read(names), strict=False)
    return Loaded(model.eval(), int(src.spec["model"].get("seq", 0)), src.spec.get("data", {}).get("path", ""),
                  str(src.path))


@torch.no_grad()
def sample(model: torch.nn.Module, ids: list[int], n: int, seq: int, temperature: float, seed: int,
           cache: bool = True) -> list[int]:
    """``n`` tokens after ``ids``; ``cache=False`` (or a model without ``forward_cached``): every token is a
    whole forward over the last ``seq`` tokens (the reference the cached path is tested against)."""
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    cached = cache and supports(model) and seq <= model_positions(model)
    if cached:   # prefill: the prompt (its last seq tokens) in one forward
        kv = KVCache.empty(model, 1, seq)
        x = torch.tensor([out[-seq:]])
        logits = model.forward_cached(x, torch.arange(x.shape[1]).unsqueeze(0), kv, write_at=slice(0, x.shape[1]))
    else:
        logits = model(torch.tensor([out[-seq:]]))
    for step in range(n):
        last = logits[0, -1].float()
        if temperature <= 0:
            nxt = int(last.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=g))
        out.append(nxt)
        if step == n - 1:
            break
        if cached and len(out) <= seq:   # the whole text is in the cache: the new token at its own position
            p = torch.tensor([len(out) - 1])
            logits = model.forward_cached(torch.tensor([[nxt]]), p.unsqueeze(1), kv, write_at=p, mask=step_mask(p))
        else:   # the window slides past seq: every position moves, nothing cached holds
            logits = model(torch.tensor([out[-seq:]]))
    return out[len(ids):]


def generate(path: str, prompt: str, tokens: int, temperature: float, seed: int, data: str | None) -> tuple[str, Loaded]:
    if tokens < 1:
        raise ConfigError(f"must be at least 1, got {tokens}", field="--tokens", value=tokens, fix="give e.g. 200")
    if temperature < 0:
        raise ConfigError(f"must be 0 or more, got {temperature}", field="--temperature", value=temperature,
                          fix="give e.g. 0.8 (0: always the most likely token)")
    if not Path(path).exists():
        raise ConfigError("no such run dir, checkpoint or export folder", field="RUN_DIR", value=path,
                          fix="give a run dir of tandem train, a checkpoint folder, or an export folder")
    loaded = load_model(Path(path))
    folder = data or loaded.data_path
    if not folder:
        raise DataError("no token folder to take the tokenizer from", field="--data", value="(empty)",
                        fix="give --data DIR, the folder tandem data prepare-text wrote for this model")
    codec = Codec(folder)
    ids = codec.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty", field="--prompt", value=prompt, fix="give some text to continue")
    vocab = loaded.model.tok_emb.num_embeddings if hasattr(loaded.model, "tok_emb") else codec.vocab
    if codec.vocab > vocab:
        raise DataError(f"the tokenizer has {codec.vocab} tokens, the model {vocab}", field="--data", value=folder,
                        fix="give the token folder this model was trained on")
    seq = loaded.seq or len(ids)
    return codec.decode(sample(loaded.model, ids, tokens, seq, temperature, seed)), loaded
