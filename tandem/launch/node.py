"""Entry of one simulated node: `python -m tandem.launch.node CONFIG.json`.

The parent (`launch(..., simulate_nodes=K)`) writes one config per node and starts
K of these; each runs a real torchrun elastic agent joined to the others by c10d.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tandem.core.errors import JobStopped, TandemError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.launch.launcher import quiet_cpp_logs, quiet_torch_logs, run_agent
from tandem.launch.orphans import die_with_parent


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    die_with_parent(cfg["parent_pid"])  # kill -9 of `tandem train`: this agent goes, and its workers with it
    quiet_cpp_logs(cfg["verbose"])
    quiet_torch_logs(cfg["verbose"])
    try:
        run_agent(LaunchSpec(**cfg["opts"]), cfg["argv"], Path(cfg["run_dir"]), agent_index=cfg["agent_index"],
                  run_id=cfg["run_id"], tee=cfg["tee"], nodes_here=cfg["nodes_here"], store_hosted=cfg["store_hosted"],
                  run_attempt=cfg["run_attempt"])
    except (WorkerFailure, JobStopped) as e:  # the parent merges every node's failures and reports once
        return e.exit_code
    except TandemError as e:
        print(f"[node {cfg['agent_index']}] error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
