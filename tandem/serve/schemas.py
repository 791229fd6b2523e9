"""What a request may hold, checked in the front against the export's config.json (no torch here).

    POST /v1/predict   {"inputs": [example, ...]}            each example: nested lists of the model's
                                                             input shape (config.json example_input
                                                             without its batch dim) and dtype
    POST /v1/generate  {"prompt": [tok, ...], "max_new_tokens": 8, "temperature": 0.0, "top_k": 0,
                        "seed": 0}                           gpt exports only
    both may add "timeout_ms": N: dropped with 504 if no replica has started it N ms after arrival

Bad input raises BadRequest with the HTTP code it answers: 400 (not JSON / not an object), 422 (wrong
shape, dtype, non-finite, out of vocabulary, out of range).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FLOAT32_MAX = 3.4028234663852886e38


class BadRequest(Exception):
    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str                 # "classifier" | "gpt"
    example_shape: list[int]  # one example (no batch dim)
    dtype: str                # "float32" | "int64"
    vocab: int = 0
    seq: int = 0

    @classmethod
    def from_export(cls, folder: Path) -> "ModelInfo":
        cfg = json.loads((Path(folder) / "config.json").read_text())
        m, desc = cfg["model"], cfg["example_input"]
        gpt = m["name"] == "gpt"
        return cls(name=m["name"], kind="gpt" if gpt else "classifier", example_shape=list(desc["shape"][1:]),
                   dtype=desc["dtype"], vocab=int(m.get("vocab", 0)) if gpt else 0,
                   seq=int(m.get("seq", 0)) if gpt else 0)

    def public(self) -> dict:
        return {"name": self.name, "kind": self.kind, "example_shape": self.example_shape, "dtype": self.dtype,
                "vocab": self.vocab, "seq": self.seq}


def parse_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise BadRequest(400, f"body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def _check(x, shape: list[int], dtype: str, vocab: int, where: str) -> None:
    """x must be nested lists of ``shape`` holding finite numbers of ``dtype``; depth is bounded by
    len(shape), so deep or huge inputs are refused without deep recursion."""
    if not shape:
        if dtype == "int64":
            if isinstance(x, bool) or not isinstance(x, int):
                raise BadRequest(422, f"{where}: expected an integer token, got {type(x).__name__}")
            if not 0 <= x < vocab:
                raise BadRequest(422, f"{where}: token {x} is out of the vocabulary 0..{vocab - 1}")
            return
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise BadRequest(422, f"{where}: expected a number, got {type(x).__name__}")
        if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
            raise BadRequest(422, f"{where}: {x!r} is not a finite float32")
        return
    if not isinstance(x, list) or len(x) != shape[0]:
        got = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
        raise BadRequest(422, f"{where}: expected a list of {shape[0]}, got {got}")
    for i, v in enumerate(x):
        _check(v, shape[1:], dtype, vocab, f"{where}[{i}]")


def predict_inputs(obj: dict, info: ModelInfo, max_batch: int) -> list:
    xs = obj.get("inputs")
    if not isinstance(xs, list) or not xs:
        raise BadRequest(422, f"inputs: expected a non-empty list of examples of shape {info.example_shape}")
    if len(xs) > max_batch:
        raise BadRequest(422, f"inputs: {len(xs)} examples is more than --max-batch {max_batch}")
    for i, x in enumerate(xs):
        _check(x, info.example_shape, info.dtype, info.vocab, f"inputs[{i}]")
    return xs


def timeout_ms(obj: dict, default: int) -> int:
    """The request's deadline in ms (0: none); its ``timeout_ms`` field, else the server's default."""
    return _int(obj, "timeout_ms", default, 0, 3_600_000)


def _int(obj: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(422, f"{key}: expected an integer in {lo}..{hi}, got {v!r}")
    return v


def generate_request(obj: dict, info: ModelInfo) -> dict:
    if info.kind != "gpt":
        raise BadRequest(422, f"this export is a {info.name} classifier: use /v1/predict")
    prompt = obj.get("prompt")
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= info.seq:
        raise BadRequest(422, f"prompt: expected a list of 1..{info.seq} tokens")
    _check(prompt, [len(prompt)], "int64", info.vocab, "prompt")
    # learned positions: the model reads at most seq tokens; the last new token is never read back
    room = info.seq + 1 - len(prompt)
    n = _int(obj, "max_new_tokens", min(8, room), 0, room)
    temp = obj.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not 0 <= temp <= 100:
        raise BadRequest(422, f"temperature: expected a number in 0..100, got {temp!r}")
    return {"prompt": prompt, "max_new_tokens": n, "temperature": float(temp),
            "top_k": _int(obj, "top_k", 0, 0, info.vocab), "seed": _int(obj, "seed", 0, 0, 2**63 - 1)}
