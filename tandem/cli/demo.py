"""`tandem demo`: the reference case (ResNet-50 on 2 machines x 2 GPUs) at CPU scale (train/demo.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from tandem.core.console import make_console
from tandem.train.demo import run_demo


def demo_cmd(
    config: str = typer.Option(None, "--config", help="Job spec of the demo (default: the packaged "
                                                      "examples/digits_resnet.toml)."),
    run_dir: str = typer.Option("runs/demo", "--run-dir", help="Where both runs go."),
) -> None:
    """The seed's case at CPU scale: 2 simulated nodes x 2 workers, DDP, bf16, cosine LR, digits.

    Measures throughput on 1 worker, then trains on 4 and prints the table.
    """
    run_demo(config, Path(run_dir), make_console())
