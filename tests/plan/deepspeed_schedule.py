"""A discrete-event model of DeepSpeed's pipeline TrainSchedule with blocking p2p, to check what MT-NLG's engine
adds to the planner's 1F1B (tests/plan/test_published_mtnlg.py).

Read from microsoft/DeepSpeed at 9351266f (January 2022, the engine MT-NLG's paper describes):
deepspeed/runtime/pipe/schedule.py ``TrainSchedule``: 2 x (m + p - 1) steps; on a step a stage runs a forward
(even step on an even stage, odd on odd) or a backward; a forward step first receives its activation from the
previous stage and then sends the previous step's input gradient back, a backward step first sends the previous
step's activation on and then receives its output gradient; deepspeed/runtime/pipe/p2p.py: send and recv are
blocking (async_op must be False), so a transfer ends only once both sides have posted it. The model: compute F a
forward, B a backward (recompute included); a transfer finishes at max(both post times) + c and holds both stages.
"""

from __future__ import annotations

_PEER = {"recv_act": "send_act", "send_grad": "recv_grad", "send_act": "recv_act", "recv_grad": "send_grad"}


def _stage_program(s: int, p: int, m: int) -> list[tuple]:
    ops, prev = [], -1
    for step in range(2 * (m + p - 1)):
        forward = step % 2 == s % 2
        if forward:
            mb = (step - s % 2) // 2 - s // 2
        elif step % 2 == 0:   # odd stage, even step
            mb = step // 2 - p + (s + 1) // 2
        else:                 # even stage, odd step
            mb = (step - 1) // 2 - p + 1 + s // 2
        now, before = 0 <= mb < m, 0 <= prev < m
        if forward and s > 0:
            ops += [("recv_act", s - 1, mb)] * now + [("send_grad", s - 1, prev)] * before
        elif not forward and s < p - 1:
            ops += [("send_act", s + 1, prev)] * before + [("recv_grad", s + 1, mb)] * now
        if now:
            ops.append(("F" if forward else "B", None, mb))
        prev = mb
    return ops


def step_time(p: int, m: int, F: float, B: float, c: float = 0.0) -> float:
    """One step of TrainSchedule on p stages with m micro-batches (the reductions after it not included)."""
    prog = [_stage_program(s, p, m) for s in range(p)]
    pc, t, posted = [0] * p, [0.0] * p, {}
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pc[s] < len(prog[s]):
                kind, peer, mb = prog[s][pc[s]]
                if kind in ("F", "B"):
                    t[s] += F if kind == "F" else B
                else:
                    mate = (peer, _PEER[kind], s, mb)
                    if mate not in posted:
                        posted[(s, kind, peer, mb)] = t[s]
                        break
                    t[s] = t[peer] = max(posted.pop(mate), t[s]) + c
                    pc[peer] += 1
                pc[s] += 1
                moved = True
    assert all(pc[s] == len(prog[s]) for s in range(p)), "the schedule deadlocked"
    return max(t)
