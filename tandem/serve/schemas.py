"""What a request may hold: pydantic models (FastAPI's, shown at /docs), then the checks that need the
export's config.json (shape, dtype, vocabulary). No torch here: the front never imports it.

    POST /v1/predict   {"inputs": [example, ...]}            nested lists of the model's input shape
                       {"inputs": {"b64": ..., "shape": [N, ...], "dtype": "float32"}}
                                                             the same as raw little-endian C-order bytes
    POST /v1/generate  {"prompt": [tok, ...] | "text": "...", "max_new_tokens": 8, "temperature": 0.0,
                        "top_k": 0, "seed": 0}               gpt exports only; text: byte-level tokens
    both may add "timeout_ms": N: dropped with 504 if no replica has started it N ms after arrival

Bad input raises BadRequest with its HTTP code and the field it is about: 400 (not JSON / not an
object), 422 (unknown field, wrong type, shape, dtype, non-finite, out of vocabulary, out of range).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np

from tandem.serve.messages import GREEDY_BELOW

from tandem.core.decoder import DECODERS
from tandem.core.extras import require

require("serve", "tandem serve")  # the whole serving stack, checked before any of it is imported: a
# missing extra is one line naming it, even where part of the stack is installed
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError  # noqa: E402

FLOAT32_MAX = 3.4028234663852886e38
BYTE_VOCAB = 256          # text prompts: UTF-8 bytes are the token ids 0..255 (`tandem data prepare-text`)
DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


class BadRequest(Exception):
    def __init__(self, code: int, msg: str, field: str = ""):
        super().__init__(f"{field}: {msg}" if field else msg)
        self.code, self.field = code, field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field ("max_tokens") is refused, not ignored


class B64Array(_Strict):
    """An array as base64 of its raw little-endian C-order bytes (numpy: ``base64.b64encode(a.tobytes())``)."""
    b64: str = Field(description="base64 of the raw bytes")
    shape: list[StrictInt] = Field(description="[N, *example shape]")
    dtype: Literal["float32", "int64"]


class PredictRequest(_Strict):
    inputs: Any = Field(description="examples: nested lists of [N, *example shape], or a B64Array "
                                    "(then the outputs come back as one too)")
    timeout_ms: Optional[StrictInt] = Field(None, ge=0, le=3_600_000, description="deadline; 0: none")


class GenerateRequest(_Strict):
    prompt: Optional[list[StrictInt]] = Field(None, description="token ids (give prompt or text)")
    text: Optional[str] = Field(None, description="a text prompt, byte-level tokens (vocab of 256 or more)")
    max_new_tokens: Optional[StrictInt] = Field(None, ge=0, description="default min(8, room left)")
    temperature: StrictFloat = Field(0.0, ge=0, le=100, allow_inf_nan=False, description="0: greedy")
    top_k: StrictInt = Field(0, ge=0, description="sample among the k largest logits; 0: all")
    seed: StrictInt = Field(0, ge=0, le=2**63 - 1, description="same seed, same tokens")
    timeout_ms: Optional[StrictInt] = Field(None, ge=0, le=3_600_000, description="deadline; 0: none")


class PredictResponse(BaseModel):
    outputs: Any = Field(description="one output per example: nested lists, or a B64Array if sent one")
    model: str


class GenerateResponse(BaseModel):
    tokens: list[int]
    prompt: list[int]
    text: Optional[str] = Field(None, description="the new tokens as UTF-8 (text prompts only)")
    model: str


class ErrorResponse(BaseModel):
    error: str = Field(description="`field: what (got value)`")
    field: str = ""


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
        gpt = m["name"] in DECODERS   # gpt and llama (MoE too): token decoders, kind "gpt" for both
        # token ids into a factory's model: bounded by the vocab= it was built with, if it takes one
        # (0: no bound known, ids go to the model as they come)
        vocab = int(m.get("vocab", 0)) if gpt else int(cfg.get("factory", {}).get("kwargs", {}).get("vocab", 0))
        return cls(name=m["name"], kind="gpt" if gpt else "classifier", example_shape=list(desc["shape"][1:]),
                   dtype=desc["dtype"], vocab=vocab, seq=int(m.get("seq", 0)) if gpt else 0)

    @property
    def text(self) -> bool:
        return self.kind == "gpt" and self.vocab >= BYTE_VOCAB

    def public(self) -> dict:
        return {"name": self.name, "kind": self.kind, "example_shape": self.example_shape, "dtype": self.dtype,
                "vocab": self.vocab, "seq": self.seq, "text": self.text}


def parse_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise BadRequest(400, f"body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def _where(loc: tuple) -> str:
    s = ""
    for p in loc:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def validate(model: type[BaseModel], obj: dict, prefix: tuple = ()) -> BaseModel:
    """``model`` from ``obj``, or BadRequest 422 naming the first bad field and what it held."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = _where(prefix + tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            raise BadRequest(422, f"unknown field (known: {known})", where) from None
        if err["type"] == "missing":
            raise BadRequest(422, "is required", where) from None
        raise BadRequest(422, f"{err['msg'].lower()} (got {_short(err.get('input'))})", where) from None


def _check(x, shape: list[int], dtype: str, vocab: int, where: str) -> None:
    """x must be nested lists of ``shape`` holding finite numbers of ``dtype``; depth is bounded by
    len(shape), so deep or huge inputs are refused without deep recursion."""
    if not shape:
        if dtype == "int64":
            if isinstance(x, bool) or not isinstance(x, int):
                raise BadRequest(422, f"expected an integer token (got {type(x).__name__})", where)
            if vocab and not 0 <= x < vocab:
                raise BadRequest(422, f"token {x} is out of the vocabulary 0..{vocab - 1}", where)
            return
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise BadRequest(422, f"expected a number (got {type(x).__name__})", where)
        if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
            raise BadRequest(422, f"{x!r} is not a finite float32", where)
        return
    if not isinstance(x, list) or len(x) != shape[0]:
        got = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
        raise BadRequest(422, f"expected a list of {shape[0]} (got {got})", where)
    for i, v in enumerate(x):
        _check(v, shape[1:], dtype, vocab, f"{where}[{i}]")


def _b64_array(obj: dict, info: ModelInfo, max_batch: int) -> np.ndarray:
    a = validate(B64Array, obj, ("inputs",))
    if a.dtype != info.dtype:
        raise BadRequest(422, f"this model takes {info.dtype} (got {a.dtype})", "inputs.dtype")
    if len(a.shape) != 1 + len(info.example_shape) or list(a.shape[1:]) != info.example_shape:
        raise BadRequest(422, f"expected [N, {', '.join(map(str, info.example_shape))}] (got {a.shape})",
                         "inputs.shape")
    if not 1 <= a.shape[0] <= max_batch:
        raise BadRequest(422, f"1..{max_batch} examples (--max-batch) (got {a.shape[0]})", "inputs.shape[0]")
    dt = DTYPES[a.dtype]
    want = int(np.prod(a.shape)) * dt.itemsize
    try:
        raw = base64.b64decode(a.b64, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(422, "is not valid base64", "inputs.b64") from None
    if len(raw) != want:
        raise BadRequest(422, f"{len(raw)} bytes where shape {a.shape} of {a.dtype} needs {want}", "inputs.b64")
    x = np.frombuffer(raw, dtype=dt).reshape(a.shape)
    if dt.kind == "f" and not np.isfinite(x).all():
        i = np.argwhere(~np.isfinite(x))[0].tolist()
        raise BadRequest(422, f"{float(x[tuple(i)])!r} is not finite", "inputs" + "".join(f"[{k}]" for k in i))
    if dt.kind == "i" and info.vocab and x.size and (x.min() < 0 or x.max() >= info.vocab):
        i = np.argwhere((x < 0) | (x >= info.vocab))[0].tolist()
        raise BadRequest(422, f"token {int(x[tuple(i)])} is out of the vocabulary 0..{info.vocab - 1}",
                         "inputs" + "".join(f"[{k}]" for k in i))
    return x


def predict_inputs(obj: dict, info: ModelInfo, max_batch: int) -> tuple[np.ndarray, bool]:
    """The examples as one array [N, *example_shape], and whether they came as base64."""
    req = validate(PredictRequest, obj)
    xs = req.inputs
    if isinstance(xs, dict):
        return _b64_array(xs, info, max_batch), True
    if not isinstance(xs, list) or not xs:
        raise BadRequest(422, f"expected a non-empty list of examples of shape {info.example_shape} or a "
                              f"base64 array {{b64, shape, dtype}} (got {_short(xs)})", "inputs")
    if len(xs) > max_batch:
        raise BadRequest(422, f"{len(xs)} examples is more than --max-batch {max_batch}", "inputs")
    for i, x in enumerate(xs):
        _check(x, info.example_shape, info.dtype, info.vocab, f"inputs[{i}]")
    return np.asarray(xs, dtype=DTYPES[info.dtype]), False


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return {"b64": base64.b64encode(a.tobytes()).decode(), "shape": list(a.shape), "dtype": str(a.dtype.name)}


def timeout_ms(obj: dict, default: int) -> int:
    """The request's deadline in ms (0: none); its ``timeout_ms`` field, else the server's default.
    Call after the request validated (the field is checked there)."""
    v = obj.get("timeout_ms")
    return default if v is None else v


def generate_request(obj: dict, info: ModelInfo) -> tuple[dict, bool]:
    """The request the replica runs, and whether the prompt came as text."""
    if info.kind != "gpt":
        raise BadRequest(422, f"this export is a {info.name} classifier: use /v1/predict", "route")
    req = validate(GenerateRequest, obj)
    if (req.prompt is None) == (req.text is None):
        raise BadRequest(422, "give exactly one of prompt (token ids) and text", "prompt")
    if req.text is not None:
        if not info.text:
            raise BadRequest(422, f"this model's vocabulary has {info.vocab} tokens, not byte-level "
                                  f"({BYTE_VOCAB} or more): send prompt as token ids", "text")
        try:
            prompt = list(req.text.encode("utf-8"))
        except UnicodeEncodeError as e:   # JSON may hold a lone surrogate ("\ud800"); UTF-8 cannot
            raise BadRequest(422, f"is not valid Unicode: a lone surrogate at character {e.start}", "text") from None
        field = "text"
    else:
        prompt, field = req.prompt, "prompt"
    if not 1 <= len(prompt) <= info.seq:
        raise BadRequest(422, f"expected 1..{info.seq} tokens (got {len(prompt)})", field)
    for i, t in enumerate(prompt):
        if not 0 <= t < info.vocab:
            raise BadRequest(422, f"token {t} is out of the vocabulary 0..{info.vocab - 1}", f"prompt[{i}]")
    # learned positions: the model reads at most seq tokens; the last new token is never read back
    room = info.seq + 1 - len(prompt)
    n = min(8, room) if req.max_new_tokens is None else req.max_new_tokens
    if n > room:
        raise BadRequest(422, f"at most {room} for a prompt of {len(prompt)} tokens (the model reads "
                              f"{info.seq}) (got {n})", "max_new_tokens")
    if req.top_k > info.vocab:
        raise BadRequest(422, f"at most the vocabulary {info.vocab} (got {req.top_k})", "top_k")
    temp = float(req.temperature)   # a tiny positive temperature is greedy (messages.py), never NaN
    return ({"prompt": prompt, "max_new_tokens": n, "temperature": 0.0 if temp <= GREEDY_BELOW else temp,
             "top_k": req.top_k,
             "seed": req.seed}, req.text is not None)


def decode_text(tokens: list[int]) -> str:
    """Byte-level tokens back to text (ids over 255, special tokens, are left out; bad UTF-8 replaced)."""
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")
