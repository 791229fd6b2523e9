"""Helpers of the export tests: checkpoints written in this process, torch's own reading of a checkpoint,
the CLI in this process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem_testing import ROOT

GPT = ROOT / "examples" / "gpt_reverse.toml"
SMALL = ["--schedule.max_steps", "2", "--data.num_samples", "256", "--schedule.global_batch", "16",
         "--schedule.micro_batch", "8", "--data.held_out", "0", "--schedule.log_every", "1"]
LAYOUTS = {
    "ddp": [str(GPT), *SMALL],
    "zero3": [str(GPT), *SMALL, "--parallel.strategy", "zero3"],
    "tp2": [str(GPT), *SMALL, "--parallel.tp", "2"],
    "pp2": [str(GPT), *SMALL, "--parallel.pp", "2", "--model.tied", "false"],
    # dp 2 x tp 2 on 4 ranks, the dp dimension sharded by FSDP2 (zero2): both in one run
    "dp2xtp2-zero2": [str(GPT), *SMALL, "--parallel.tp", "2", "--parallel.strategy", "zero2",
                      "--schedule.micro_batch", "4", "--launch.nproc_per_node", "4"],
}


def write_checkpoint(run: Path, model_overrides: dict | None = None, step: int = 5, mutate=None,
                     example_input: dict | None = None) -> Path:
    """A run dir of the GPT example (``model_overrides`` applied) with one checkpoint: publish_checkpoint."""
    from tandem.core.config import load_spec

    spec = load_spec(GPT, check=False)
    for k, v in (model_overrides or {}).items():
        setattr(spec.model, k, v)
    return publish_checkpoint(run, spec, step, mutate, example_input)


def publish_checkpoint(run: Path, spec, step: int, mutate=None, example_input: dict | None = None) -> Path:
    """RUN/spec.json and one checkpoint of ``spec``'s model (seeded by ``step``; ``mutate(state_dict)`` may
    change it first; ``example_input``: a train sample's record, as the trainer keeps it), as `tandem train`
    lays them out, written by this process with the trainer's own publish step (sha256 manifest, atomic
    rename, ``latest``)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tandem.core.config import to_dict
    from tandem.models import build_model, model_signature
    from tandem.train import checkpoint as ckpt
    from tandem.train.checkpoint_meta import CheckpointMeta

    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps(to_dict(spec), indent=1))
    torch.manual_seed(step)
    model = build_model(spec.model)
    sd = model.state_dict()
    if mutate:
        mutate(sd)
    cdir = run / "checkpoints"
    tmp = cdir / f".tmp-step-{step:08d}"
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
    meta = CheckpointMeta(step=step, epoch=0, world_size=1, model=spec.model.name, signature=model_signature(model),
                          parallel={"strategy": "ddp", "tp": 1, "pp": 1}, example_input=example_input)
    ckpt.publish_files(cdir, step, tmp, cdir / f"step-{step:08d}", meta, keep_last=2)
    return run


def reference_state(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors through torch's own converter (whole load, another code path)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"ref-{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    if not out.exists():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(checkpoint), str(out))
    return torch.load(out, weights_only=False)["model"]


def latest_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`tandem ARGV` in this process, through the real CLI entry: (exit code, stdout, stderr)."""
    from tandem.cli import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    cap = capsys.readouterr()
    return code, cap.out, cap.err
