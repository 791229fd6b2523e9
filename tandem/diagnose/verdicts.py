"""Advice: each verdict names its trigger, the numbers it used, and the setting to change.

Triggers (docs/diagnose.md explains each):

    data-bound         data >= DATA_PCT of the step on a rank (median over the window)
    latency-bound      exposed comm >= COMM_PCT (on the rank that waits least) and
                       >= MANY_BUCKETS gradient all-reduces per step,
                       median bucket < SMALL_BUCKET bytes: per-call latency dominates
    no-overlap         exposed comm >= COMM_PCT, one gradient all-reduce per step, overlap < LOW_OVERLAP:
                       the one bucket can only start when the backward is over
    bandwidth-bound    exposed comm >= COMM_PCT otherwise: the bytes themselves
    straggler          a section whose score (fastest rank's median / this rank's) < 0.75, by at least
                       5% of the step and 0.5 ms, in at least 3/4 of the window's steps, its exposed
                       communication left out; cause "cpu-starved" when the rank's main thread waited
                       in the run queue (more than the least-waiting rank) for half the excess or more

A rank's shares are its medians over the window's steps; verdicts that apply to every rank say so.
Evidence lines name the rank they are about. A verdict's proposed setting is weighed against the
step-time what-ifs (``weigh``): one the model predicts slower is never the change; the best what-if
that is faster is, or "no change found that helps".
"""

from __future__ import annotations

DATA_PCT = 10.0
COMM_PCT = 10.0
MANY_BUCKETS = 4
SMALL_BUCKET = 1 << 20
LOW_OVERLAP = 25.0
STARVED_SHARE = 0.5   # a straggler whose extra run-queue wait covers half its excess: its host, not its code


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.3g} MiB"


def _ranks(rs: list[int], world: int) -> str:
    return "every rank" if len(rs) == world and world > 1 else "rank " + ", ".join(map(str, rs))


def judge(rep: dict) -> list[dict]:
    out = []
    spec, world, ranks = rep.get("spec") or {}, rep["world"], rep["ranks"]
    metrics = rep.get("metrics") or {}

    data = [r for r in ranks if r["median"]["data_pct"] >= DATA_PCT]
    if data:
        workers = spec.get("num_workers")
        ev = [f"rank {r['rank']}: data {r['median']['data_pct']:.1f}% of a {r['median']['step_ms']:.1f} ms step"
              for r in data]
        if metrics.get("data_pct") is not None and any(r["rank"] == 0 for r in data):  # it is rank 0's record
            ev.append(f"rank 0's metrics.jsonl (data_time_s / step_time_s): {metrics['data_pct']:.1f}%")
        more = max(2, 2 * workers) if workers else 2
        out.append({"kind": "data-bound", "ranks": [r["rank"] for r in data],
                    "title": f"data-bound on {_ranks([r['rank'] for r in data], world)}",
                    "evidence": ev,
                    "change": f"raise data.num_workers from {workers if workers is not None else '?'} to {more} "
                              "(loading then overlaps the step); on GPUs pin memory; if the workers are "
                              "already busy, make the dataset's __getitem__ cheaper"})

    # Judged on the rank that waits least: a rank waiting for a late peer shows exposed communication
    # that no bucket setting removes (that is the straggler verdict's business).
    least = min(ranks, key=lambda r: r["median"]["comm_pct"]) if ranks else None
    comm = ranks if least and least["median"]["comm_pct"] >= COMM_PCT else []
    if comm:
        r0 = least
        c, m = r0["collectives"], r0["median"]
        n, size, total = c["grad_allreduce_per_step"], c["grad_bucket_bytes_median"], c["grad_bytes_per_step"]
        cap = spec.get("bucket_cap_mb")
        ev = [f"rank {r['rank']}: exposed communication {r['median']['comm_pct']:.1f}% of the step, overlap "
              f"{r['median']['overlap_pct']:.0f}%" for r in comm]
        ev.append(f"even the rank that waits least (rank {r0['rank']}) spends {r0['median']['comm_pct']:.1f}% "
                  "exposed: the transfers themselves, not a wait for a late peer")
        ev.append(f"rank {r0['rank']}: {n:g} gradient all-reduce(s) per step, median bucket {_mib(size)}, {_mib(total)} per step"
                  + (f" (parallel.bucket_cap_mb {cap:g})" if cap is not None else ""))
        bw = r0.get("comm_spans", {}).get("grad_MBps")
        if bw:
            ev.append(f"rank {r0['rank']}: the collectives of 1 KiB or more move {bw:g} MB/s each (bytes / span): far below the link's "
                      "rate (tandem bench) means the time is latency or a busy host, not bandwidth")
        ids = [r["rank"] for r in comm]
        if n >= MANY_BUCKETS and size < SMALL_BUCKET:
            new = max((cap or 0) * 8, total / (1 << 20) / 2)
            out.append({"kind": "latency-bound", "ranks": ids, "evidence": ev,
                        "setting": {"parallel.bucket_cap_mb": float(f"{new:.3g}")},
                        "title": f"communication latency-bound: {n:g} small all-reduces per step",
                        "change": f"raise parallel.bucket_cap_mb to {new:.3g} (about 2 buckets per step): "
                                  "fewer calls, each paying the per-call latency once"})
        elif n == 1 and m["overlap_pct"] < LOW_OVERLAP:
            new = total / (1 << 20) / 4
            out.append({"kind": "no-overlap", "ranks": ids, "evidence": ev,
                        "setting": {"parallel.bucket_cap_mb": float(f"{new:.3g}")},
                        "title": "no overlap: one gradient bucket, sent after the backward",
                        "change": f"lower parallel.bucket_cap_mb to {new:.3g} (about 4 buckets per step): the "
                                  "first ones are sent while the backward still runs"})
        else:
            out.append({"kind": "bandwidth-bound", "ranks": ids, "evidence": ev,
                        "title": "communication bandwidth-bound",
                        "change": "send fewer bytes per sample: parallel.comm_hook bf16 (or powersgd), gradient "
                                  "accumulation (a larger schedule.global_batch at the same micro_batch) or a "
                                  "larger schedule.micro_batch"})

    secs = rep.get("sections") or {}
    resid_ms = rep["clock"]["residual_us"] / 1e3
    by_rank: dict[int, list[dict]] = {}
    for st in secs.get("stragglers", []):  # worst score first
        by_rank.setdefault(st["rank"], []).append(st)
    for rank, ss in by_rank.items():
        r = next(x for x in ranks if x["rank"] == rank)
        worst, late = ss[0], r["lateness_ms"]
        ev = [f"section {s['section']}: median {s['median_ms']:.1f} ms on rank {rank} vs {s['fastest_ms']:.1f} ms on "
              f"the fastest rank, score {s['score']:.2f} (< 0.75; exposed communication left out), slow in "
              f"{s['slow_steps']} of {s['steps']} steps" for s in ss]
        if late["per_step"] > resid_ms:
            ev.append(f"rank {rank} arrives last at the collectives: {late['per_step']:.1f} ms after the first "
                      f"rank in the median step, {late['max']:.1f} ms at most (clock residual {resid_ms:.3f} ms)")
        fr = r.get("fr_lateness_ms")
        if fr and fr["per_step"] > resid_ms:
            ev.append(f"flight recorder: rank {rank} enqueued the same collectives (by sequence number) up to "
                      f"{fr['per_step']:.1f} ms after the first rank in the median step ({fr['collectives']} matched)")
        rq = {x["rank"]: (x.get("main_thread") or {}).get("runqueue_ms_per_step") for x in ranks}
        excess = sum(s["median_ms"] - s["fastest_ms"] for s in ss)
        starved = None not in rq.values() and rq[rank] - min(rq.values()) >= STARVED_SHARE * excess
        if rq[rank] is not None:
            ev.append(f"rank {rank}'s main thread waited {rq[rank]:.1f} ms a step for a CPU (run queue, "
                      f"/proc schedstat; least on any rank {min(v for v in rq.values() if v is not None):.1f} ms) "
                      f"against {excess:.1f} ms of excess in its slow sections")
        if starved:
            hint = ("host: it was runnable but not running, so its host's CPUs are oversubscribed (other "
                    "processes, loader workers, too many threads per rank: launch.threads_per_worker), not its code")
        elif len(ss) >= 3:
            hint = ("host: it is slower in every section alike, so look at its CPU share (other processes on "
                    "its cores), clocks and throttling, not at one piece of code")
        elif worst["section"] == "data":
            hint = "data path: a slow disk or remote file system, or loader workers starved of CPU"
        else:
            hint = (f"{worst['section']}: its inputs (uneven sequence lengths or batch shapes), or its host's CPU/GPU "
                    "clocks and other processes")
        names = ", ".join(s["section"] for s in ss)
        out.append({"kind": "straggler", "ranks": [rank], "section": worst["section"],
                    "cause": "cpu-starved" if starved else "code-or-device",
                    "sections": [s["section"] for s in ss], "evidence": ev,
                    "title": f"straggler: rank {rank} in {names}",
                    "change": f"look at rank {rank}'s {hint}; every other rank waits for it at the next "
                              "collective. A slow rank that moves between runs points at data"})
    return out


def _label(setting: dict) -> str:
    return " ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in setting.items())


def weigh(verdicts: list[dict], step_time: dict | None) -> None:
    """A proposed setting the step-time model (steptime.py, the planner on this run's rates)
    predicts slower than the run as it is is not the change: the fastest what-if that beats the run
    takes its place, or the verdict says that no change found helps. The rejected setting stays
    in the verdict (``rejected``) with the model's ratio."""
    rows = [r for r in (step_time or {}).get("rows", []) if r.get("vs_now") is not None]
    if not rows:
        return
    by = {r["setting"]: r for r in rows}
    now_ms = step_time["now"]["step_ms"]
    for v in verdicts:
        mine = by.get(_label(v["setting"])) if v.get("setting") else None
        if mine is None or mine["vs_now"] <= 1.0:
            continue
        v["rejected"] = {"setting": v.pop("setting"), "step_ms": mine["step_ms"], "vs_now": mine["vs_now"]}
        why = (f"the model on this run's rates predicts {mine['setting']} at {mine['step_ms']:.3g} ms a step, "
               f"{mine['vs_now']:.2f}x the {now_ms:.3g} ms of the run as it is")
        best = min((r for r in rows if r["vs_now"] < 1.0), key=lambda r: r["step_ms"], default=None)
        if best is None:
            v["change"] = (f"no change found that helps: {why}, and none of the {len(rows)} settings it priced "
                           "(the step-time what-ifs) is faster")
        else:
            v["setting"] = dict(best["changes"])
            v["change"] = (f"{best['setting']} (the fastest step-time what-if: {best['step_ms']:.3g} ms a step, "
                           f"{best['vs_now']:.2f}x); not {mine['setting']}: {why}")
