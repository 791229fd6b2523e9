"""Per-rank log files named by global rank, for torchrun's elastic agent.

torchrun's DefaultLogsSpecs nests logs as <dir>/<run_id>_<rand>/attempt_<k>/<local_rank>/;
with several nodes local ranks repeat, so we name files by the global RANK the
agent assigns at (re)start:

    run_dir/logs/rank-<R>.log        stdout of global rank R (the trainer logs here)
    run_dir/logs/rank-<R>.err.log    stderr (tracebacks, warnings)
    run_dir/errors/rank-<R>.json     torch's @record error file (exception + traceback)

After a restart (attempt k > 0) the names gain ``.restart<k>`` so that the first
failure's logs survive; a later start of the run dir (a rerun, a resume: run attempt
N > 1, see core/rundir.py) gains ``.attempt<N>`` before it, so that no start's logs
are overwritten. k counts this agent's worker starts: torchrun's restart count
does not move when the group restarts for a node that joined (a membership change is
not a retry), and those restarts need their own files too. Workers get k as
TANDEM_AGENT_STARTS (the group agrees on one attempt from it, see elastic/resume.py).

An agent that joins a running job (``TANDEM_JOINING=1``, set by ``tandem train
--elastic.join true``) counts from 0 while the others are further on, and torchrun may
give its workers ranks the first nodes had: its files carry ``.join-<host>-<pid>`` so that
they never overwrite theirs.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map
from tandem.core import rundir
from tandem.core.contract import AGENT_STARTS_ENV, JOINING_ENV  # noqa: F401 (JOINING_ENV re-exported)



class RankLogsSpecs(LogsSpecs):
    def __init__(self, run_dir: Path, tee: bool = True, run_attempt: int = 1) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        (self.run_dir / rundir.ERRORS).mkdir(parents=True, exist_ok=True)
        super().__init__(str(self.run_dir / rundir.LOGS), redirects=Std.ALL, tee=Std.ALL if tee else Std.NONE)
        self.starts = 0  # worker group starts of this agent so far
        self.stderr_of: dict[int, str] = {}  # global rank -> its stderr file in the latest start
        joining = os.environ.get(JOINING_ENV) == "1"
        self.agent_tag = f".join-{socket.gethostname()}-{os.getpid()}" if joining else ""
        self.run_attempt = run_attempt  # a later start of the run dir: names of its own (never overwritten)

    @property
    def root_log_dir(self) -> str:
        return str(self.run_dir / rundir.LOGS)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        tee = to_map(self._tee, len(envs))
        attempt = max(self.starts, *(int(e.get("TORCHELASTIC_RESTART_COUNT", "0")) for e in envs.values()))
        self.starts += 1
        if self.run_attempt == rundir.NODE0_ATTEMPT:  # node 0 has recorded its start by now (see there)
            starts = rundir.attempts(self.run_dir)
            self.run_attempt = starts[-1]["attempt"] if starts else 1
        for local_rank, env in envs.items():
            rank = env.get("RANK", str(local_rank))
            env[AGENT_STARTS_ENV] = str(attempt)
            tag = rundir.log_tag(rank, self.run_attempt, attempt, self.agent_tag)
            dest.stdouts[local_rank] = str(self.run_dir / rundir.LOGS / f"{tag}.log")
            dest.stderrs[local_rank] = str(self.run_dir / rundir.LOGS / f"{tag}.err.log")
            self.stderr_of[int(rank)] = dest.stderrs[local_rank]
            err = self.run_dir / rundir.ERRORS / f"{tag}.json"
            if err.exists():  # a stale file from an earlier run would be read as this failure
                os.remove(err)
            dest.error_files[local_rank] = str(err)
            env["TORCHELASTIC_ERROR_FILE"] = str(err)  # where the worker's @record writes
            if tee[local_rank] & Std.OUT:
                dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
            if tee[local_rank] & Std.ERR:
                dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
        return dest
