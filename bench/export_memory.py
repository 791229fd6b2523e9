"""Peak memory and time of `tandem export` (streamed) against a whole load + safetensors' save_file.

    python bench/export_memory.py [--size-gib 1] [--tensor-mib 64] [--dir /tmp/tandem-export-bench]

A synthetic checkpoint (a user's model, ``pkg.module:factory``, of N fp32 matrices of the given
size; written by DCP as a 2-rank save would be read: one process, no process group) is exported
three ways, each in a fresh process whose peak RSS is read from the kernel (``wait4``):

  baseline   tandem export of the same model shrunk to tiny matrices: the import baseline
  streamed   tandem export of the big checkpoint (tensors read one group at a time)
  whole      every model tensor loaded at once (what torch's dcp_to_torch_save does), then
             safetensors.torch.save_file

It prints both peaks, their ratio, the times, and checks the streamed peak against the bound
baseline + 2 x the largest tensor + 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLACK = 64 << 20   # the "small constant": allocator slack, the JSON header, Python objects

FACTORY = '''"""A model of {n} fp32 matrices of {rows} x {cols} (bench/export_memory.py)."""
import torch
from torch import nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.mats = nn.ParameterList([nn.Parameter(torch.empty({rows}, {cols})) for _ in range({n})])
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return x


def build(num_classes=10, in_channels=3):
    return Stack()
'''

WRITE = '''
import json, sys, warnings, torch
import torch.distributed.checkpoint as dcp
from pathlib import Path
from tandem.core.config import load_spec, to_dict
from tandem.models import build_model, model_signature
from tandem.train import checkpoint as ckpt
from tandem.train.checkpoint_meta import CheckpointMeta
run = Path(sys.argv[1]); name = sys.argv[2]
spec = load_spec(None, check=False)
spec.model.name = name
run.mkdir(parents=True, exist_ok=True)
(run / "spec.json").write_text(json.dumps(to_dict(spec), indent=1))
torch.manual_seed(0)
model = build_model(spec.model)
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
sd = model.state_dict()
cdir = run / "checkpoints"; tmp = cdir / ".tmp-step-00000001"; tmp.mkdir(parents=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # no fsync: a bench input, rewritten if lost; the export under test reads it from the page cache either way
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=False), no_dist=True)
meta = CheckpointMeta(step=1, epoch=0, world_size=1, model=name, signature=model_signature(model),
                      parallel={"strategy": "ddp", "tp": 1, "pp": 1})
ckpt.publish_files(cdir, 1, tmp, cdir / "step-00000001", meta, keep_last=1)
'''

WHOLE = '''
import sys, warnings
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from safetensors.torch import save_file
sd = {}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _load_state_dict(sd, storage_reader=FileSystemReader(sys.argv[1]), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
save_file({k: v.contiguous() for k, v in sd["model"].items()}, sys.argv[2], metadata={"format": "pt"})
'''


def run_wait4(argv: list[str], env: dict) -> tuple[int, float, str]:
    """Run a child; (its peak RSS in bytes from wait4's rusage, seconds, stdout). Output goes through
    files, so nothing but wait4 reaps the child."""
    d = Path(env["TANDEM_BENCH_DIR"])
    out_p, err_p = d / "child.out", d / "child.err"
    t0 = time.perf_counter()
    with open(out_p, "w") as out_f, open(err_p, "w") as err_f:
        p = subprocess.Popen(argv, env=env, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    dt = time.perf_counter() - t0
    out, err = out_p.read_text(), err_p.read_text()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:5])} exited {p.returncode}: {err[-2000:]}")
    return usage.ru_maxrss * 1024, dt, out


def prepare(d: Path, size_gib: float, tensor_mib: int) -> dict:
    """Write the factory modules and both checkpoints (big and tiny); returns paths and sizes."""
    d.mkdir(parents=True, exist_ok=True)
    cols = 4096
    rows = tensor_mib * (1 << 20) // (4 * cols)
    n = max(1, round(size_gib * 1024 / tensor_mib))
    (d / "tandem_bench_big.py").write_text(FACTORY.format(n=n, rows=rows, cols=cols))
    (d / "tandem_bench_tiny.py").write_text(FACTORY.format(n=n, rows=4, cols=8))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(d)]), "TANDEM_BENCH_DIR": str(d)}
    for name in ("big", "tiny"):
        run = d / f"run-{name}"
        if not (run / "checkpoints" / "latest").is_file():
            subprocess.run([sys.executable, "-c", WRITE, str(run), f"tandem_bench_{name}:build"], env=env,
                           check=True)
    return {"dir": d, "env": env, "n": n, "tensor_bytes": rows * cols * 4, "total_bytes": n * rows * cols * 4}


def measure(p: dict, whole_load: bool = True) -> dict:
    """The three peaks (the whole load only if asked: it writes another copy of the checkpoint)."""
    d, env = p["dir"], p["env"]
    tandem = [sys.executable, "-m", "tandem", "export"]
    base, _, _ = run_wait4([*tandem, str(d / "run-tiny"), "--out", str(d / "out-tiny"), "--force", "--json"], env)
    peak, t_stream, out = run_wait4([*tandem, str(d / "run-big"), "--out", str(d / "out-big"), "--force",
                                        "--json"], env)
    summary = json.loads(out)
    ckpt = d / "run-big" / "checkpoints" / "step-00000001"
    whole, t_whole = float("nan"), float("nan")
    if whole_load:
        whole, t_whole, _ = run_wait4([sys.executable, "-c", WHOLE, str(ckpt), str(d / "whole.safetensors")], env)
        (d / "whole.safetensors").unlink()
    bound = base + 2 * p["tensor_bytes"] + SLACK
    return {"checkpoint_bytes": p["total_bytes"], "largest_tensor_bytes": p["tensor_bytes"], "tensors": p["n"],
            "baseline_peak_bytes": base, "streamed_peak_bytes": peak, "whole_peak_bytes": whole,
            "bound_bytes": bound, "within_bound": peak <= bound, "peak_ratio_whole_over_streamed": whole / peak,
            "streamed_s": t_stream, "whole_s": t_whole, "time_ratio_streamed_over_whole": t_stream / t_whole,
            "export_summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/tandem-export-bench"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(prepare(a.dir, a.size_gib, a.tensor_mib))
    if a.json:
        print(json.dumps(r, indent=1))
        return
    mib = 1 << 20
    print(f"checkpoint: {r['checkpoint_bytes'] / mib:.0f} MiB in {r['tensors']} tensors of "
          f"{r['largest_tensor_bytes'] / mib:.0f} MiB")
    print(f"import baseline (tiny export)   peak RSS {r['baseline_peak_bytes'] / mib:7.0f} MiB")
    print(f"tandem export (streamed)        peak RSS {r['streamed_peak_bytes'] / mib:7.0f} MiB  "
          f"{r['streamed_s']:.1f} s   bound {r['bound_bytes'] / mib:.0f} MiB "
          f"({'within' if r['within_bound'] else 'OVER'})")
    print(f"whole load + save_file          peak RSS {r['whole_peak_bytes'] / mib:7.0f} MiB  {r['whole_s']:.1f} s")
    print(f"ratio: whole / streamed peak = {r['peak_ratio_whole_over_streamed']:.2f}x; "
          f"streamed / whole time = {r['time_ratio_streamed_over_whole']:.2f}x")


if __name__ == "__main__":
    main()
