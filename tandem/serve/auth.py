"""API keys (`tandem serve --api-key-file F`): one key per line, `#` comments and blank lines skipped.

A client sends ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``). The presented key is hashed and
compared with every stored key's hash by ``hmac.compare_digest``, all of them, so the time taken
says neither which key nor how much of one matched; a missing header, another scheme and a wrong key
all get the same 401. Keys are kept only as SHA-256 digests in memory and never printed or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from tandem.core.errors import ConfigError

MIN_LEN = 16
OPEN_PATHS = frozenset({"/livez", "/readyz"})   # health checks of load balancers carry no key
FIELD = "--api-key-file"
GENERATE = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_file(cls, path: Path) -> "ApiKeys":
        return cls(read_keys(path))

    def check(self, presented: str | None) -> bool:
        """True when ``presented`` is one of the keys; the same work whatever it is (or if missing)."""
        d = _digest(presented or "")
        ok = False
        for k in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(d, k)
        return ok and presented is not None


def read_keys(path: Path) -> list[str]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read it ({type(e).__name__})", field=FIELD, value=str(path),
                          fix="give a readable text file with one key per line") from None
    keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys:
        raise ConfigError("holds no key", field=FIELD, value=str(path),
                          fix=f"write one key per line, e.g. from {GENERATE}")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < MIN_LEN or any(c.isspace() for c in k)]
    if short:  # its number only: never the key itself
        raise ConfigError(f"key {short[0]} (of {len(keys)}) is shorter than {MIN_LEN} characters or holds "
                          f"spaces", field=FIELD, value=str(path), fix=f"use long random keys, e.g. {GENERATE}")
    return keys


def first_key(path: Path) -> str:
    """The key a client (`tandem bench serve --api-key-file`) sends."""
    return read_keys(path)[0]


def presented_key(headers) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return headers.get("x-api-key")


def loose_permissions(path: Path) -> bool:
    """True when others than the owner may read the key file."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False
