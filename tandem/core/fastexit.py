"""Leave a process that imported torch without paying for the interpreter's teardown.

Python's finalization frees every module one by one: with torch and DCP imported that costs
about a second of CPU (docs/bench.md, "Measurements behind the code's choices"). A job pays it
in every worker and again in the launcher, at each start and restart; the test suite pays it a
few hundred times.

So a process entry point (the ``tandem`` command, a worker) ends with ``run_and_exit``: once
its function has returned, it runs the atexit handlers (log handlers flush, sockets are
removed), flushes stdout and stderr, and leaves with ``os._exit``. What the teardown would
have done beyond that is freeing memory the kernel frees anyway. An exception other than
SystemExit is not caught: it ends the process the usual way, traceback and all.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Callable, NoReturn


def run_and_exit(fn: Callable[..., object], *args: object) -> NoReturn:
    try:
        fn(*args)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): Python prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)
