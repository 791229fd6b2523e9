"""Worker entry of `tandem train`: `python -m tandem.train.worker RUN_DIR`.

The parent validated the spec and wrote it to RUN_DIR/spec.json (the artifact between
the CLI and the workers); every worker reads it, trains, and rank 0 writes
RUN_DIR/result.json. ``@record`` writes the traceback of a failure to the error file
the launcher assigned, for the root-cause summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from tandem.core.config import from_dict
from tandem.train import runtime as rt
from tandem.train.trainer import train
from tandem.core import rundir


class _AtomicErrorFile(ErrorHandler):
    """torch writes the error file with open('w') + write. A rank that fails on a lost peer is
    often SIGKILLed by its agent while writing it; the agent then reads an empty file and
    fails itself (JSONDecodeError) instead of restarting the group. Write-then-rename: the
    agent finds either no file or a whole one."""

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        tmp = f"{file_path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as fp:
                fp.write(error_msg)
            os.replace(tmp, file_path)
        except OSError as e:
            print(f"could not write the error file {file_path}: {e}", file=sys.stderr)

    def record_exception(self, e: BaseException) -> None:  # torch's content, written atomically
        file = self._get_error_file_path()
        if file:
            info = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}
            self._write_error_file(file, json.dumps({"message": {"message": f"{type(e).__name__}: {e}",
                                                                 "extraInfo": info}}))


def main(run_dir: str) -> None:
    run = Path(run_dir)
    spec = from_dict(json.loads((run / rundir.SPEC).read_text()))
    ctx = rt.init()
    ok = False
    try:
        result = train(spec, ctx, run)
        if ctx.is_main:
            tmp = run / f"{rundir.RESULT}.tmp"
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(run / rundir.RESULT)
        ok = True
    finally:
        # a failed rank closes at once (its peers may be dead). No drain: the process leaves by os._exit
        # (under Ray it lives on), so no interpreter finalization races gloo's threads
        rt.shutdown(ok, drain_s=0)


main = record(main, error_handler=_AtomicErrorFile())

if __name__ == "__main__":
    from tandem.core.fastexit import run_and_exit

    run_and_exit(main, sys.argv[1])  # skips ~1.5 s of torch teardown per worker, at every (re)start
