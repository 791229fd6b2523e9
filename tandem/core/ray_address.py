"""`--address` of a Ray cluster, checked before ray.init: one TCP connect and one line.

``ray.init(address=...)`` retries for about a minute before it gives up on an address nobody
answers at; `tandem submit --on ray` and `tandem serve --engine ray` both join a cluster as a
driver on one of its nodes, so both refuse the same addresses the same way.
"""

from __future__ import annotations

import socket

from tandem.core.errors import ConfigError, LaunchError

FLAG = "--address"
CONNECT_TIMEOUT_S = 5.0
_GIVE = "give the head's GCS address HOST:PORT as `ray start --head` printed it (e.g. 10.0.0.1:6379)"


def check_ray_address(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Nothing for no address (the caller starts a local Ray); else a head must answer at HOST:PORT."""
    if not address:
        return
    if address.startswith("ray://"):   # a client's driver would not see the run dir / export path
        raise ConfigError("Ray Client addresses (ray://) are not supported", field=FLAG, value=address,
                          fix=f"run tandem on a cluster node and {_GIVE}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("not a Ray head address HOST:PORT", field=FLAG, value=address,
                          fix=f"{_GIVE}, or leave {FLAG} out to start a local Ray")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise LaunchError(f"no Ray head answers there ({e.strerror or e})", field=FLAG, value=address,
                          fix=f"start one with `ray start --head` (and `ray start --address HEAD:PORT` on the "
                              f"other machines), or leave {FLAG} out to start a local Ray") from None
