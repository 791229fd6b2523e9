"""Elastic training and fault tolerance on torchrun's agent and DCP.

    resume.py     which checkpoint a (re)started group resumes from; data position across world sizes;
                  the restart report (time lost, steps redone)

    watchdog.py   a thread in each agent: no progress for T s -> dump stacks, name the first stopped
                  rank, end the group so that torchrun restarts it
    straggler.py  per-rank data-wait (and busy) times compared every K steps
    faults.py     fault injection (TANDEM_FAULTS) for the tests
    fault_tolerance.py  the one object the trainer calls (heartbeat, stop, saves, restart report)
    stop.py       SIGTERM/Ctrl-C: save at an agreed step; a peer's death: exit at once
See docs/elastic.md.
"""
