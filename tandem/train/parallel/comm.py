"""Count the bytes each rank hands to collectives, per step, for every strategy.

Three taps, because the strategies reach the process group three ways:

- Python calls on ``torch.distributed`` (FSDP2's all-gather / reduce-scatter, ZeRO-1's
  broadcasts, pipeline send/recv, the gradient all-reduce of tp/pp, expert parallel's
  all-to-alls): the functions are
  wrapped while the counter is installed;
- DTensor's functional collectives (tensor parallel): a TorchDispatchMode sees the
  ``_c10d_functional`` ops;
- DDP's bucketed all-reduce (C++): a communication hook counts each bucket (``comm_hooks.py``
  calls ``record`` with what it actually sends, compressed or not).

``payload`` is the buffer size per call (what the planner's CommOp ``bytes`` means);
``sent`` is what a rank pushes through its link under ring algorithms: all-reduce
2(n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x the full buffer, broadcast
(n-1)/n x payload on average, send its size.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE: list["CommCounter"] = []

# name -> (kind, which tensor holds the full buffer: "in" or "out")
_PY = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
       "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
       "broadcast": "broadcast", "all_to_all_single": "all_to_all"}
_FUNC = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
         "all_reduce_coalesced": "all_reduce"}
_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
           "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _size(group) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:
        return 1


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: step()`` then ``c.summary()``; nests with other modes."""

    def __init__(self):
        super().__init__()
        self.calls: dict = defaultdict(int)
        self.payload: dict = defaultdict(float)
        self.sent: dict = defaultdict(float)
        self._saved: dict = {}

    def record(self, kind: str, nbytes: float, n: int, calls: int = 1) -> None:
        if n <= 1 and kind != "send":
            return
        self.calls[kind] += calls
        self.payload[kind] += nbytes
        self.sent[kind] += nbytes * _FACTOR[kind](max(n, 1))

    # --- Python-level collectives
    def _wrap(self, name: str, fn):
        kind = _PY[name]

        @functools.wraps(fn)
        def inner(*args, **kw):
            group = kw.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            t = args[0] if args else kw.get("tensor", kw.get("output", kw.get("output_tensor")))
            if kind == "reduce_scatter":  # the full input
                t = args[1] if len(args) > 1 else kw.get("input", kw.get("input_tensor", t))
            self.record(kind, _nbytes(t), _size(group) if kind != "send" else 2)
            return fn(*args, **kw)
        return inner

    def __enter__(self):
        for name in _PY:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        from torch.distributed.pipelining import schedules
        batch = schedules._batch_p2p   # pipeline p2p; dist.isend itself must stay unwrapped (compared by identity)
        self._saved_p2p = batch

        def counted(p2p_ops, *a, **kw):
            for op in p2p_ops:
                if op.op is dist.isend:
                    self.record("send", _nbytes(op.tensor), 2)
            return batch(p2p_ops, *a, **kw)
        schedules._batch_p2p = counted
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        from torch.distributed.pipelining import schedules
        schedules._batch_p2p = self._saved_p2p
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    # --- functional collectives (DTensor)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        name = func._overloadpacket.__name__
        if ns in ("_c10d_functional", "c10d_functional") and name in _FUNC:
            kind = _FUNC[name]
            t = args[0]
            nbytes = _nbytes(t)
            n = next((a for a in args[1:] if isinstance(a, int) and a > 0), None)
            group_name = next((a for a in reversed(args[1:]) if isinstance(a, str)), None)  # last: group
            if group_name is not None:
                try:
                    from torch.distributed.distributed_c10d import _resolve_process_group
                    n = _size(_resolve_process_group(group_name))
                except Exception:
                    pass
            n = n or 1
            if kind == "all_gather":
                nbytes *= n   # the gathered buffer
            self.record(kind, nbytes, n)
        return func(*args, **kwargs)

    def summary(self, steps: int = 1) -> dict:
        return {k: {"calls": self.calls[k] / steps, "payload_bytes": self.payload[k] / steps,
                    "sent_bytes": self.sent[k] / steps} for k in sorted(self.calls)}


def record(kind: str, nbytes: float, n: int) -> None:
    """Called by DDP's counting hooks: feeds every active counter."""
    for c in _ACTIVE:
        c.record(kind, nbytes, n)
