"""Fault injection inside a replica, for the watchdog's tests (and for rehearsing an incident by hand).

``TANDEM_SERVE_FAULTS`` holds comma-separated faults, each ``kind:token=T``; a fault fires on a
continuous-batching join whose prompt starts with token T, in every replica (restarts included):

    lose:token=13       the replica forgets the request silently: no token, no answer (a request lost
                        inside a busy replica: the front's per-request watchdog answers it 500)
    sigkill:token=14    the replica SIGKILLs itself (a request that kills every replica it reaches:
                        the front retries it once, then answers it 500)
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TANDEM_SERVE_FAULTS"


def parse(text: str) -> dict[int, str]:
    """{first prompt token: kind}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, rest = item.partition(":")
        key, _, tok = rest.partition("=")
        if kind not in ("lose", "sigkill") or key != "token" or not tok.isdigit():
            raise SystemExit(f"error: {ENV}: {item!r} is not a fault (got {text!r}). Fix: lose:token=T or "
                             f"sigkill:token=T, comma-separated")
        out[int(tok)] = kind
    return out


class Faults:
    def __init__(self, text: str | None = None):
        self.by_token = parse(os.environ.get(ENV, "") if text is None else text)

    def lose(self, request: dict) -> bool:
        """True when this join is to be forgotten; SIGKILLs this process for a sigkill fault."""
        if not self.by_token or not request.get("prompt"):
            return False
        kind = self.by_token.get(request["prompt"][0])
        if kind:
            print(f"tandem serve fault injection: {kind} on a request starting with token {request['prompt'][0]}",
                  file=sys.stderr, flush=True)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return kind == "lose"
