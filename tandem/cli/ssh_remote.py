"""What `tandem submit --on ssh` runs on each host: `python -m tandem.cli.ssh_remote SSHD_PID ARGS...`.

sshd leaves a command without a terminal running when its connection drops (the client
killed, the network gone): the agent would train on with nobody reading its output. So the
agent asks the kernel for SIGTERM when its parent, the ssh session's sshd process (``$PPID``
of the remote shell, which execs into this), ends: torchrun's agent then stops its workers
as on any SIGTERM (a tandem train job saves on the way out), and its workers die with it
(orphans.py). Then it runs `tandem ARGS...` in this process.
"""

from __future__ import annotations

import signal
import sys

from tandem.cli import main as cli_main
from tandem.core.fastexit import run_and_exit
from tandem.launch.orphans import die_with_parent


def main(args: list[str]) -> None:
    die_with_parent(int(args[0]), signal.SIGTERM)
    run_and_exit(cli_main, args[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
