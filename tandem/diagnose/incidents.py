"""The rest of a run's story in diagnose's report: the hang watchdog's dumps and an NCCL log.

* Hangs: the watchdog (tandem/launch/watchdog.py) writes ``RUN_DIR/watchdog/hang-attempt<k>-node<i>.json``
  when a rank stops making progress: the rank that stopped first and why (its process state), each
  rank's step, torch's flight-recorder reading of who waits in which collective, and where the
  stacks went. diagnose lists every one (the run went on after a restart, so a finished run can
  have several), as a ``hang`` verdict each.
* NCCL: ``tandem diagnose RUN_DIR --nccl-log FILE`` reads an ``NCCL_DEBUG=INFO`` log with the parser
  ``tandem doctor --nccl-log`` uses (nccl_log.py): transports per peer, rings/trees/channels, and the
  known bad signs (sockets despite InfiniBand, P2P/SHM disabled, one channel, no Init COMPLETE,
  WARN lines), each warn/fail an ``nccl`` verdict with its fix.

A run dir without a profiler window still gets these two parts: one command tells what happened.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.diagnose import nccl_log
from tandem.diagnose.checks import FAIL, WARN


def hangs(run_dir: Path) -> list[dict]:
    out = []
    files = sorted(Path(run_dir).glob("watchdog/hang-attempt*-node*.json"),
                   key=lambda p: (int(p.name.split("attempt")[1].split("-")[0]), p.name))
    for p in files:
        try:
            h = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            out.append({"file": str(p), "error": f"unreadable: {e}"})
            continue
        out.append({"file": str(p), "attempt": h.get("attempt"), "node": h.get("node"),
                    "first_stopped_rank": h.get("first_stopped_rank"), "why": h.get("why"),
                    "timeout_s": h.get("timeout_s"),
                    "steps": {r: x.get("step") for r, x in (h.get("ranks") or {}).items()},
                    "states": {r: x.get("state") for r, x in (h.get("ranks") or {}).items()},
                    "collective_waits": h.get("collective_waits") or [],
                    "stack_files": h.get("stack_files") or {}})
    return out


def nccl(path: Path) -> dict:
    s = nccl_log.read(path)   # a DataError (one line, exit 2) when it is not an NCCL log
    checks = nccl_log.judge(s)
    return {"file": str(path), "version": s.version, "network": s.network, "transports": dict(s.transports),
            "rings": s.rings, "trees": s.trees, "channels": s.channels, "nranks": s.nranks,
            "checks": [c.to_dict() for c in checks]}


def verdicts(rep: dict) -> list[dict]:
    out = []
    for h in rep.get("hangs") or []:
        if "error" in h:
            continue
        r = h["first_stopped_rank"]
        ev = [f"watchdog (attempt {h['attempt']}, node {h['node']}, limit {h['timeout_s']:g} s): rank {r} stopped "
              f"first: {h['why']}",
              "steps at the hang: " + ", ".join(f"rank {k} step {v}" for k, v in sorted(h["steps"].items()))]
        ev += [f"flight recorder: {w}" for w in h["collective_waits"]]
        stack = h["stack_files"].get(str(r))
        if stack:
            ev.append(f"rank {r}'s stacks: {stack}")
        ev.append(f"report: {h['file']}")
        left_behind = any("never entered" in w for w in h["collective_waits"])
        out.append({"kind": "hang", "ranks": [r], "evidence": ev,
                    "title": f"hang: rank {r} stopped first (restart attempt {h['attempt']})",
                    "change": (f"read rank {r}'s stack: the line it stopped on is the cause"
                               + ("; the others waited in a collective it never entered" if left_behind else "")
                               + " (a process stopped from outside, a deadlock, or a collective only some ranks "
                                 "call, e.g. under `if rank == 0`)")})
    n = rep.get("nccl")
    for c in (n or {}).get("checks", []):
        if c["status"] in (WARN, FAIL):
            out.append({"kind": "nccl", "ranks": [], "title": f"nccl: {c['name']} ({c['status']})",
                        "evidence": [c["detail"], f"log: {n['file']}"], "change": c["fix"]})
    return out


def render(rep: dict, console) -> None:
    hs = rep.get("hangs") or []
    if hs:
        console.print(f"hangs: {len(hs)} watchdog report(s) in {rep.get('run_dir') or 'the run dir'}/watchdog",
                      highlight=False)
    n = rep.get("nccl")
    if n:
        tr = ", ".join(f"{k} x{v}" for k, v in sorted(n["transports"].items())) or "none logged"
        console.print(f"NCCL {n['version'] or '?'} ({n['file']}): network {n['network'] or '?'}, transports {tr}; "
                      f"{n['rings']} rings, {n['trees']} trees, {n['channels']} channels, {n['nranks'] or '?'} ranks",
                      highlight=False)
