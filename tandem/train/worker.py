"""Worker entry of `tandem train`: `python -m tandem.train.worker RUN_DIR`.

The parent validated the spec and wrote it to RUN_DIR/spec.json (the artifact between
the CLI and the workers); every worker reads it, trains, and rank 0 writes
RUN_DIR/result.json. ``@record`` writes the traceback of a failure to the error file
the launcher assigned, for the root-cause summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from tandem.core.config import from_dict
from tandem.train import runtime as rt
from tandem.train.trainer import train


@record
def main(run_dir: str) -> None:
    run = Path(run_dir)
    spec = from_dict(json.loads((run / "spec.json").read_text()))
    ctx = rt.init()
    try:
        result = train(spec, ctx, run)
        if ctx.is_main:
            tmp = run / "result.json.tmp"
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(run / "result.json")
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
