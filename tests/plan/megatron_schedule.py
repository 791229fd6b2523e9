"""A discrete-event model of Megatron-LM's interleaved 1F1B schedule with blocking p2p, to check the planner's
pipeline terms (stages.fill_units, cost.py's pp-p2p count) against the schedule MegaScale's baseline ran.

Read from Megatron-LM at commit 285068c8 (January 2023; MegaScale §6.1 names it as its baseline),
megatron/schedules.py ``forward_backward_pipelining_with_interleaving`` and megatron/p2p_communication.py
``_communicate``: rank r runs (p - r - 1) x 2 + (v - 1) x p warm-up chunk forwards (all m x v when m == p), chunk
ids cycle every p micro-batches, and after each warm-up forward, each steady 1F1B pair and each cool-down backward it
makes ONE combined call: isend/irecv to both neighbours batched (batch_isend_irecv), every request waited on, then
torch.cuda.synchronize(). Nothing overlaps a transfer (no overlap_p2p_comm in that version), and a call cannot
finish before the peer posts the matching call: "implemented together and can be blocked by the slower one"
(MegaScale §3.2). The model: a call finishes at max(its own post time, each peer's matching post time) + c x
(the larger of its sends and its receives, which share the GPU's one NIC each way). Compute is F per chunk forward,
B per chunk backward, + the logits (head forward, 2 x head backward) on the last chunk of the last stage.

``overlap=True``: Megatron-core's ``overlap_p2p_comm`` (read at df727128, the commit MLPerf v3.1's NeMo GPT-3
submissions pin; megatron/core/pipeline_parallel/schedules.py): the warm-up and steady-state calls are posted
asynchronously (p2p_communication ``wait_on_reqs=False``) and waited just before the tensor they bring is needed:
a warm-up forward's send/recv before the next forward (nothing runs in between), a steady forward's before the next
forward (its backward runs in between), a steady backward's before the next backward (the next forward runs in
between); the cool-down's calls stay blocking. A posted request completes c x (its sends or receives) after both
sides have posted it, whatever the ranks compute meanwhile.
"""

from __future__ import annotations

from collections import defaultdict


def _rank_program(r: int, p: int, v: int, m: int, F: float, B: float, head: float, overlap: bool = False) -> list:
    n = m * v
    first, last = r == 0, r == p - 1

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def fwd(c: int) -> tuple:
        return ("run", F + (head if last and c == v - 1 else 0.0))

    def bwd(c: int) -> tuple:
        return ("run", B + (2 * head if last and c == v - 1 else 0.0))

    prog: list = []

    def call(send_next=False, send_prev=False, recv_prev=False, recv_next=False) -> None:
        ops = ([("send", (r + 1) % p, "act")] if send_next else []) + \
              ([("send", (r - 1) % p, "grad")] if send_prev else []) + \
              ([("recv", (r - 1) % p, "act")] if recv_prev else []) + \
              ([("recv", (r + 1) % p, "grad")] if recv_next else [])
        if ops:
            prog.append(("p2p", ops))

    def post(handle: str, **kw) -> None:   # overlap_p2p_comm: the same call, waited on later
        before = len(prog)
        call(**kw)
        if len(prog) > before:
            prog[-1] = ("post", (handle, prog[-1][1]))
            prog.append(("mark", handle))   # the handle now exists: a later ("wait", handle) waits on it

    def wait(handle: str) -> None:
        prog.append(("wait", handle))

    all_warmup = m == p
    warm = n if all_warmup else min(n, (p - r - 1) * 2 + (v - 1) * p)
    if not first:
        call(recv_prev=True)
    for k in range(warm):   # warm-up forwards, each followed by one call
        c = chunk(k, True)
        wait("fwd")
        prog.append(fwd(c))
        recv_prev = not (first and chunk(k + 1, True) == 0) and k != n - 1
        closing = k == warm - 1 and not all_warmup   # the last one also fetches the first gradient
        if not overlap:
            call(send_next=not (last and c == v - 1), recv_prev=recv_prev, recv_next=closing and not last)
            continue
        post("fwd", send_next=not (last and c == v - 1), recv_prev=recv_prev)
        if closing:
            post("bwd", recv_next=not last)
    steady = n - warm
    for k in range(steady):   # 1F1B: a forward, a backward, one call both ways (two when overlapped)
        fc, bc = chunk(k + warm, True), chunk(k, False)
        recv_prev = not (first and chunk(k + warm - (p - 1), True) == v - 1) and k != steady - 1
        recv_next = not (last and chunk(k - (p - 1), False) == 0)
        if not overlap:
            prog += [fwd(fc), bwd(bc)]
            call(send_next=not (last and fc == v - 1), send_prev=not (first and bc == 0), recv_prev=recv_prev,
                 recv_next=recv_next)
            continue
        wait("fwd")
        prog.append(fwd(fc))
        post("fwd", send_next=not (last and fc == v - 1), recv_prev=recv_prev)
        wait("bwd")
        prog.append(bwd(bc))
        post("bwd", send_prev=not (first and bc == 0), recv_next=recv_next)
    wait("bwd")
    if all_warmup:
        call(recv_next=not last)
    for k in range(steady, n):   # cool-down backwards
        bc = chunk(k, False)
        prog.append(bwd(bc))
        recv_next = not (last and chunk(k + 1, False) == v - 1) and k != n - 1
        call(send_prev=not (first and bc == 0), recv_next=recv_next)
    return prog


def step_time(p: int, v: int, m: int, F: float, B: float, c: float, head: float = 0.0,
              overlap: bool = False) -> float:
    """Seconds from the first forward to the last rank's last call (v >= 2: the interleaved schedule)."""
    progs = [_rank_program(r, p, v, m, F, B, head, overlap) for r in range(p)]
    t, pc = [0.0] * p, [0] * p
    posted: dict[tuple, list[float]] = defaultdict(list)   # (kind, src, dst, tag) -> post times, FIFO per pair
    mine: dict[tuple, list] = {}
    handles: list[dict] = [{} for _ in range(p)]   # overlap: handle -> (program index of its post, ops)
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pc[r] < len(progs[r]):
                kind, arg = progs[r][pc[r]]
                if kind == "run":
                    t[r] += arg
                    pc[r] += 1
                    moved = True
                    continue
                if kind == "mark":   # the post just before is this handle's
                    handles[r][arg] = (pc[r] - 1, progs[r][pc[r] - 1][1][1])
                    pc[r] += 1
                    moved = True
                    continue
                if kind == "wait" and arg not in handles[r]:   # nothing posted under it (yet): no wait
                    pc[r] += 1
                    moved = True
                    continue
                if kind == "post":   # requests recorded now, completion waited on at the handle's "wait"
                    handle, ops = arg
                    reqs = []
                    for op, peer, tag in ops:
                        key = (op, r, peer, tag) if op == "send" else (op, peer, r, tag)
                        reqs.append((key, len(posted[key]), t[r]))
                        posted[key].append(t[r])
                    mine[(r, pc[r])] = reqs
                    pc[r] += 1
                    moved = True
                    continue
                if kind == "wait":
                    at, ops = handles[r][arg]
                    end = t[r]
                    for (op, src, dst, tag), i, own in mine[(r, at)]:
                        match = posted[("recv" if op == "send" else "send", src, dst, tag)]
                        if len(match) <= i:
                            break
                        sends = sum(1 for o, _, _ in ops if o == "send")
                        end = max(end, max(own, match[i]) + c * max(sends, len(ops) - sends))
                    else:
                        t[r] = end
                        del handles[r][arg]
                        pc[r] += 1
                        moved = True
                        continue
                    break
                if (r, pc[r]) not in mine:   # post this call's requests once
                    reqs = []
                    for op, peer, tag in arg:
                        key = (op, r, peer, tag) if op == "send" else (op, peer, r, tag)
                        reqs.append((key, len(posted[key])))
                        posted[key].append(t[r])
                    mine[(r, pc[r])] = reqs
                    moved = True
                end = t[r]
                for (op, src, dst, tag), i in mine[(r, pc[r])]:
                    match = posted[("recv" if op == "send" else "send", src, dst, tag)]
                    if len(match) <= i:
                        break
                    end = max(end, match[i])
                else:
                    sends = sum(1 for op, _, _ in arg if op == "send")
                    t[r] = end + c * max(sends, len(arg) - sends)
                    pc[r] += 1
                    moved = True
                    continue
                break
    if any(pc[r] < len(progs[r]) for r in range(p)):
        raise RuntimeError(f"schedule deadlocked at {pc}")
    return max(t)
