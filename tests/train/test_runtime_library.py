"""The runtime as a library (README "Use the runtime in your own script"), under `tandem launch`."""

import json

import pytest

from tandem_testing import run_tandem

SCRIPT = '''
import json, sys
import torch
import torch.distributed as dist
from torch import nn
from tandem.core.spec import ParallelSpec
from tandem.train import runtime as rt
from tandem.train.sampler import ResumableDistributedSampler

ctx = rt.init()
torch.manual_seed(0)
model = rt.wrap_ddp(nn.Linear(4, 2).to(ctx.device), ctx, ParallelSpec(bucket_cap_mb=50))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)))
sampler = ResumableDistributedSampler(data, ctx.world, ctx.rank, seed=0)
loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
accum = 2
for i, (x,) in enumerate(loader):
    with rt.no_sync(model, skip=(i + 1) % accum != 0), rt.autocast(ctx, "fp32"):
        loss = model(x).pow(2).mean() / accum
        loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
w = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.zeros_like(w) for _ in range(ctx.world)]
dist.all_gather(every, w)
if ctx.is_main:
    open(sys.argv[1], "w").write(json.dumps({"ddp": type(model).__name__,
                                             "spread": max((e - w).abs().max().item() for e in every)}))
rt.shutdown()
'''


@pytest.mark.slow
def test_readme_runtime_snippet_trains_in_step_on_two_workers(tmp_path):
    script, out = tmp_path / "my_script.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    r = run_tandem("launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(script), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ddp"] == "DistributedDataParallel"
    assert res["spread"] == 0.0  # DDP kept the replicas identical through accumulation
