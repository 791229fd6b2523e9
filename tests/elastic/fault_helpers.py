"""Helpers of the fault-injection suite: real `tandem train` runs, real signals, file waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tandem.core.heartbeat import read as read_heartbeat
from tandem_testing import ROOT, TINY, wait_for  # noqa: F401 (the fault tests import it from here)

# One epoch of digits (1438 train samples: nothing dropped or padded at world 1 or 2) in 45 steps.
BASE = dict(model="resnet18", remainder="drop", global_batch=32, micro_batch=8, max_steps=0, dtype="fp32",
            every=10, keep=3, nproc=2)
EXTRA = """
[elastic]
straggler_every = {straggler_every}
"""


def write_spec(path: Path, run_dir: Path, straggler_every: int = 0, **kw) -> Path:
    vals = {**BASE, **kw, "run_dir": str(run_dir)}
    path.write_text(TINY.format(**vals) +
                    EXTRA.format(straggler_every=straggler_every))
    return path


def start_train(spec: Path, *overrides: str, env: dict | None = None, own_group: bool = False) -> subprocess.Popen:
    """``own_group``: the job in a process group of its own, as a terminal's foreground job
    (os.killpg then does what Ctrl-C does)."""
    full = {**os.environ, "COLUMNS": "200", "TANDEM_TRACE_SAMPLES": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "tandem", "train", "--json", str(spec), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT,
                            process_group=0 if own_group else None)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def heartbeat(run_dir: Path, rank: int) -> dict | None:
    return read_heartbeat(Path(run_dir) / "heartbeat" / f"rank-{rank}.json")


def at_step(run_dir: Path, rank: int, step: int) -> dict:
    """Rank ``rank``'s heartbeat once it reports ``step`` or later."""
    return wait_for(lambda: (h := heartbeat(run_dir, rank)) and h["step"] >= step and h,
                    timeout=180, what=f"rank {rank} to reach step {step}", interval=0.01)


def kill_node_at_step(run_dir: Path, rank: int, step: int) -> dict:
    """kill -9 the simulated node of rank ``rank`` once it reaches ``step``: its torchrun agent and its
    worker (in a session of its own, so not taken down with the agent). The rank's last heartbeat."""
    hb = at_step(run_dir, rank, step)
    os.kill(hb["ppid"], signal.SIGKILL)
    os.kill(hb["pid"], signal.SIGKILL)
    return hb


def sigkill_at_step(proc: subprocess.Popen, run_dir: Path, victim: int, step: int) -> tuple[dict, dict]:
    """kill -9 rank ``victim`` once its heartbeat reaches ``step``; the run must still succeed.
    Returns the victim's last heartbeat and the run's result."""
    hb = at_step(run_dir, victim, step)
    os.kill(hb["pid"], signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    return hb, json.loads(out)


def final_state(ckpt: Path) -> dict:
    """Model and optimizer tensors of a DCP checkpoint, flattened (loaded without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(ckpt).parent.parent / f"{Path(ckpt).name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v
    walk("", sd)
    return flat


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def samples_seen(run_dir: Path, world: int | None = None) -> dict[int, list[int]]:
    """Per step, the sample indices that step trained on (all ranks), keeping for each step
    the record of the last attempt that ran it (a redone step replaces the failed try)."""
    by_step: dict[int, dict[int, tuple[int, list[int]]]] = {}
    for p in (Path(run_dir) / "samples").glob("rank-*.attempt*.jsonl"):
        rank = int(p.name.split("-")[1].split(".")[0])
        attempt = int(p.name.split("attempt")[1].split(".")[0])
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            cur = by_step.setdefault(rec["step"], {})
            cur[rank] = max(cur.get(rank, (-1, [])), (attempt, rec["idx"]))
    out = {}
    for step, ranks in sorted(by_step.items()):
        newest = max(a for a, _ in ranks.values())
        out[step] = sorted(i for a, idx in ranks.values() if a == newest for i in idx)
    return out


def records(run_dir: Path, kind: str) -> list[dict]:
    from tandem.train import metrics

    return [r for r in metrics.read(run_dir) if r["kind"] == kind]


def processes_with(text: str) -> list[int]:
    """Live processes whose command line names ``text`` (a run dir or its node configs): none may
    outlive the job."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and int(d.name) != os.getpid():
                found.append(int(d.name))
    return found
