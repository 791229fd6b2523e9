"""``tandem generate RUN_DIR|CHECKPOINT|EXPORT --prompt TEXT``: sample text from a trained language model.

The weights come as ``tandem export`` reads them: a run dir (its newest checkpoint) or a checkpoint
folder, its tensors assembled by DCP from whatever layout saved them (ddp, zero3, tp, pp), or an
export folder (tandem.export.load). The tokenizer is the token folder's (tandem data prepare-text
wrote it, tandem.data.text.Codec reads it back): the run's ``data.path`` (for an export folder inside
its run dir too) unless ``--data DIR`` says otherwise. Sampling is plain: the logits of the last
position over the model's last ``seq`` tokens, divided by the temperature (0: the most likely token),
one token at a time, from a torch.Generator seeded by ``--seed``.
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
def sample(model: torch.nn.Module, ids: list[int], n: int, seq: int, temperature: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(n):
        x = torch.tensor([out[-seq:]])
        logits = model(x)[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        out.append(nxt)
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
