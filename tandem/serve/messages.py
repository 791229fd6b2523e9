"""What the front and a replica say to each other, typed (one module, shared by both ends): the
frames on a replica's stdin (Predict, Generate, Join, Cancel) and stdout (Ready, Outputs, Array,
Tokens, Held, Error), each one JSON header line then the header's ``nbytes`` raw bytes, built by
``encode`` and read by ``parse_request`` / ``parse_reply`` (replica.py's docstring shows the wire
format). No torch, no pydantic: the front and the replica both import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Optional, Union

# A temperature at or under this samples greedily (vLLM's _SAMPLING_EPS). A positive temperature as small
# as 1e-39 is a valid float, but logits / 1e-39 overflow to inf and softmax gives NaN: such a request is
# answered as greedy (the limit of sampling as temperature goes to 0), never lost.
GREEDY_BELOW = 1e-5

# ---- front -> replica (one JSON header line with "op", then the header's "nbytes" raw bytes) ----


@dataclass
class Predict:
    """Examples to run: ``raw`` holds them as little-endian C-order bytes of ``shape`` and ``dtype``."""
    shape: list
    dtype: str
    id: Optional[int] = None   # continuous batching: answered by id, between decode steps
    raw: bytes = field(default=b"", repr=False)
    op = "predict"


@dataclass
class Generate:
    """A static batch of generate requests, answered together by one Outputs."""
    requests: list
    op = "generate"


@dataclass
class Join:
    """One request joins the running batch at the next decode step (continuous batching)."""
    id: int
    request: dict
    stream: bool = False   # also a Tokens frame after each step that decoded some
    op = "join"


@dataclass
class Cancel:
    """Drop ``id`` before the next step (its client went away, a stop sequence, the watchdog)."""
    id: int
    op = "cancel"


Request = Union[Predict, Generate, Join, Cancel]
REQUESTS = {c.op: c for c in (Predict, Generate, Join, Cancel)}

# ---- replica -> front (told apart by their fields: the wire format has no op) ----


@dataclass
class Ready:
    """Once, after the warm-up forward."""
    pid: int
    warmup_s: float
    kv_cache: bool = False
    continuous: bool = False
    tp: int = 1
    tp_pids: list = field(default_factory=list)
    ready: bool = True


@dataclass
class Outputs:
    """Generated tokens: one request's (``id`` set), or a static batch's (a list per request, None for
    one that failed alone, its reason in ``errors`` by index)."""
    outputs: list
    id: Optional[int] = None
    errors: Optional[dict] = None
    cancelled: bool = False   # answered to a Cancel: the tokens decoded before it


@dataclass
class Array:
    """Predict outputs: ``raw`` as little-endian float32 bytes of ``shape``."""
    shape: list
    dtype: str = "float32"
    id: Optional[int] = None
    raw: bytes = field(default=b"", repr=False)


@dataclass
class Tokens:
    """A streamed request's tokens decoded since its last Tokens frame; ``at`` came before them."""
    id: int
    tokens: list
    at: int = 0


@dataclass
class Held:
    """A heartbeat (continuous batching, every --heartbeat-s, busy or idle): {id: tokens decoded so far}
    of every request the replica holds."""
    held: dict


@dataclass
class Error:
    """A request (``id``), or a static batch, failed."""
    error: str
    id: Optional[int] = None


Reply = Union[Ready, Outputs, Array, Tokens, Held, Error]
_REPLY_KEYS = (("ready", Ready), ("held", Held), ("tokens", Tokens), ("error", Error), ("outputs", Outputs),
               ("shape", Array))


def encode(msg) -> bytes:
    """A message as its frame: the header (fields left at None or False omitted; ``op`` for a request)
    and its raw bytes."""
    raw = getattr(msg, "raw", b"")
    hdr = {"op": msg.op} if hasattr(type(msg), "op") else {}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if f.name != "raw" and v is not None and v is not False:
            hdr[f.name] = v
    hdr["nbytes"] = len(raw)
    return json.dumps(hdr).encode() + b"\n" + raw


def _build(cls, hdr: dict, raw: bytes):
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in hdr.items() if k in names}
    if "raw" in names:
        kw["raw"] = raw
    return cls(**kw)


def parse_request(hdr: dict, raw: bytes = b"") -> Request:
    """The replica's side: a header line (and its bytes) as the request it is."""
    cls = REQUESTS.get(hdr.get("op"))
    if cls is None:
        raise ValueError(f"not a request frame (op {hdr.get('op')!r})")
    return _build(cls, hdr, raw)


def parse_reply(hdr: dict, raw: bytes = b"") -> Reply:
    """The front's side: a header line (and its bytes) as the reply it is."""
    for key, cls in _REPLY_KEYS:
        if key in hdr:
            return _build(cls, hdr, raw)
    raise ValueError(f"not a reply frame (keys {sorted(hdr)})")


async def read_reply(stream) -> Reply:
    """One reply from a replica's stdout (an asyncio StreamReader): ConnectionError at its end."""
    line = await stream.readline()
    if not line:
        raise ConnectionError("replica closed its stdout")
    hdr = json.loads(line)
    return parse_reply(hdr, await stream.readexactly(int(hdr.get("nbytes", 0))))
