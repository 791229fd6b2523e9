"""Arithmetic of a world-size change: elastic.on_resize (keep_batch | scale_lr), the schedule
re-anchored by the linear scaling rule, the steps left, validation, attempt naming."""

import math

import pytest
import torch

from tandem.core.config import load_spec
from tandem.core.errors import ConfigError
from tandem.core.validate import validate
from tandem.launch.logs import RankLogsSpecs
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.train.elastic.resume import plan_resize, steps_left
from tandem.train.schedule import Schedule, lr_factor
from tandem_testing import TINY

VALS = dict(model="resnet18", remainder="drop", global_batch=32, micro_batch=8, max_steps=0, dtype="fp32",
            every=10, keep=3, nproc=1)


def spec(tmp_path, *overrides, **kw):
    p = tmp_path / "job.toml"
    p.write_text(TINY.format(**{**VALS, **kw, "run_dir": str(tmp_path / "run")}))
    return load_spec(str(p), list(overrides))


def cosine(pos, total=45, warmup=2):  # the configured curve, written out independently of lr_factor
    if pos < warmup:
        return (pos + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (pos - warmup) / (total - warmup))))


def test_keep_batch_recomputes_accumulation_and_keeps_the_lr(tmp_path):
    s = spec(tmp_path)
    rz = plan_resize(s, CheckpointMeta(step=10, epoch=0, data_world=2, consumed=160, grad_accum=2, global_batch=32), 1)
    assert (rz.accum, rz.global_batch, rz.ratio, rz.changed) == (4, 32, 1.0, True)
    fresh = plan_resize(s, None, 2)
    assert (fresh.accum, fresh.global_batch, fresh.ratio, fresh.changed) == (2, 32, 1.0, False)


def test_scale_lr_keeps_micro_and_accumulation_and_scales_the_batch(tmp_path):
    s = spec(tmp_path, "--elastic.on_resize", "scale_lr")
    shrink = plan_resize(s, CheckpointMeta(step=10, epoch=0, data_world=2, grad_accum=2, global_batch=32), 1)
    assert (shrink.accum, shrink.global_batch, shrink.ratio) == (2, 16, 0.5)
    assert shrink.record()["old_global_batch"] == 32 and shrink.record()["new_global_batch"] == 16
    started_on_1 = CheckpointMeta(step=10, epoch=0, data_world=1, grad_accum=4, global_batch=32)
    grow = plan_resize(s, started_on_1, 2)  # started on 1 node
    assert (grow.accum, grow.global_batch, grow.ratio) == (4, 64, 2.0)
    # a checkpoint written before on_resize existed (read through the one reader, which upgrades it)
    old_ckpt = plan_resize(s, CheckpointMeta.from_dict({"step": 10, "epoch": 0, "world_size": 2}), 1)
    assert (old_ckpt.accum, old_ckpt.global_batch) == (2, 16)


def test_schedule_resize_scales_the_lr_and_continues_the_curve():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.05)
    sched = Schedule(opt, 45, 2, "cosine", 0.0)
    for _ in range(10):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.05 * cosine(10))
    sched.resize(10, 0.5, 70)  # 2 -> 1 data ranks: half the batch, 70 steps left
    assert sched.horizon == 45  # 10 + 70 x 0.5: the decay still ends with the run
    lrs = [sched.get_last_lr()[0]]
    for _ in range(69):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    want = [0.05 * 0.5 * cosine(10 + k * 0.5) for k in range(70)]
    assert lrs == pytest.approx(want, rel=1e-12)
    assert opt.param_groups[0]["lr"] == lrs[-1]
    # a restart restores the anchor with the state and goes on along the same curve
    state = sched.state_dict()
    opt2 = torch.optim.SGD([w], lr=0.05)
    again = Schedule(opt2, 999, 2, "cosine", 0.0)
    again.load_state_dict(state)
    again.horizon = 45
    assert again.factor(79) == pytest.approx(0.5 * cosine(10 + 69 * 0.5), rel=1e-12)


def test_unresized_schedule_is_bitwise_the_plain_one():
    w = torch.nn.Parameter(torch.zeros(1))
    a, b = torch.optim.SGD([w], lr=0.05), torch.optim.SGD([w], lr=0.05)
    sa = Schedule(a, 45, 2, "cosine", 0.1)
    sb = torch.optim.lr_scheduler.LambdaLR(b, lambda s: lr_factor(s, 45, 2, "cosine", 0.1))
    for _ in range(45):
        assert sa.get_last_lr() == sb.get_last_lr()
        a.step(), b.step(), sa.step(), sb.step()


def test_steps_left_counts_the_epoch_at_the_new_batch(tmp_path):
    s = spec(tmp_path, "--elastic.on_resize", "scale_lr")
    # 320 of 1438 samples done; world 1 at 16 per step: 1118 left = 69 full steps + 14
    assert steps_left(s, 0, 320, 1438, 16, 90, 10.0, 0.5) == 70
    s2 = spec(tmp_path, "--elastic.on_resize", "scale_lr", max_steps=20)  # 20 configured-batch steps
    assert steps_left(s2, 0, 320, 1438, 16, 90, 10.0, 0.5) == 20  # 10 of them left, at half the batch


def test_validation_of_on_resize_and_join(tmp_path):
    with pytest.raises(ConfigError, match="elastic.on_resize: 'scale' is not one of keep_batch, scale_lr"):
        validate(spec(tmp_path, "--elastic.on_resize", "scale"))
    validate(spec(tmp_path, "--elastic.on_resize", "scale_lr", "--launch.simulate_nodes", "2",
                  "--launch.nnodes", "1:2"))
    with pytest.raises(ConfigError, match="which 3 data ranks cannot share evenly") as e:
        validate(spec(tmp_path, "--elastic.on_resize", "scale_lr", "--launch.simulate_nodes", "3",
                      "--launch.nnodes", "2:3", global_batch=96, micro_batch=16))
    assert "on_resize=keep_batch" in str(e.value)
    with pytest.raises(ConfigError, match="elastic.join: joining a running job needs elastic nnodes"):
        validate(spec(tmp_path, "--elastic.join", "true"))
    validate(spec(tmp_path, "--elastic.join", "true", "--launch.nnodes", "1:2", "--launch.rdzv_endpoint",
                  "127.0.0.1:29400"))


def test_log_names_and_attempt_count_worker_starts_of_the_agent(tmp_path):
    logs = RankLogsSpecs(tmp_path)
    env = {0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}}
    first = logs.reify({0: dict(env[0])})
    envs = {0: dict(env[0], RANK="1")}  # a restart for a joined node: torchrun's count stays 0
    second = logs.reify(envs)
    assert first.stdouts[0].endswith("rank-0.log") and second.stdouts[0].endswith("rank-1.restart1.log")
    assert envs[0]["TANDEM_AGENT_STARTS"] == "1"
