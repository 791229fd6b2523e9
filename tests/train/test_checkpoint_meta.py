"""A checkpoint's meta.json through its one reader: today's file and every older shape load, upgraded in
one place, and each reader of the meta (resume, rerun checks, a restarted group's search) acts on them
as it did on the raw keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.config import load_spec
from tandem.core.errors import CheckpointError, ConfigError
from tandem.train import checkpoint as ckpt
from tandem.train import checkpoint_meta
from tandem.train.checkpoint_meta import VERSION, CheckpointMeta
from tandem.train.run import check_same_layout, finished
from tandem.train.elastic.resume import carry_position, layout_of, plan_resize, schedule_key
from tandem_testing import ROOT

EXAMPLE = ROOT / "examples" / "digits_resnet.toml"
QUIET = dict(log=lambda *a, **k: None)

# what tandem wrote before meta.json had a version (trainer + fault tolerance + publish), fp16 run
TODAY = {"epoch": 1, "consumed": 96, "scheduler": {"last_epoch": 12, "ratio": 1.0}, "model": "resnet18",
         "signature": {"fc.weight": [10, 64]}, "job": "digits", "data_world": 2, "grad_accum": 2,
         "global_batch": 32, "parallel": {"strategy": "ddp", "tp": 1, "pp": 1}, "total_steps": 40,
         "schedule_key": {"epochs": 2, "max_steps": 0, "global_batch": 32, "micro_batch": 8},
         "grad_scaler": {"scale": 1024.0}, "run_id": "abc123", "step": 12, "world_size": 2}
ONLY = ("data_world", "parallel", "global_batch", "grad_accum", "total_steps", "schedule_key", "consumed",
        "grad_scaler", "run_id")


def spec(*overrides: str):
    return load_spec(EXAMPLE, list(overrides), check=False)


def folder(tmp_path: Path, meta: dict, name: str = "step-00000012") -> Path:
    """A complete checkpoint folder (no manifest: nothing to verify) holding this meta.json."""
    p = tmp_path / "checkpoints" / name
    p.mkdir(parents=True)
    (p / ".metadata").write_bytes(b"dcp")
    (p / "meta.json").write_text(json.dumps(meta, indent=1))
    return p


def without(*keys: str) -> dict:
    return {k: v for k, v in TODAY.items() if k not in keys}


def test_todays_file_reads_every_key(tmp_path):
    m = ckpt.read_meta(folder(tmp_path, TODAY))
    assert (m.step, m.epoch, m.consumed, m.world_size, m.data_world) == (12, 1, 96, 2, 2)
    assert (m.global_batch, m.grad_accum, m.total_steps, m.run_id, m.job) == (32, 2, 40, "abc123", "digits")
    assert m.scheduler == TODAY["scheduler"] and m.grad_scaler == {"scale": 1024.0}
    assert m.signature == TODAY["signature"] and m.model == "resnet18" and m.parallel == TODAY["parallel"]
    assert m.version == VERSION


def test_the_writer_keeps_every_key_and_adds_the_version(tmp_path):
    m = CheckpointMeta.from_dict(TODAY)
    written = json.loads(m.to_json())
    assert written == {**TODAY, "version": VERSION}  # other tools read these keys by name
    assert CheckpointMeta.from_dict(written) == m
    checkpoint_meta.write(tmp_path, CheckpointMeta(step=3, epoch=0))
    assert "grad_scaler" not in json.loads((tmp_path / "meta.json").read_text())  # only where a scaler ran


def test_before_tp_and_pp_the_world_was_the_data_world(tmp_path):
    m = ckpt.read_meta(folder(tmp_path, {**without("data_world"), "world_size": 4, "consumed": 40}))
    assert (m.world_size, m.data_world) == (4, 4)
    assert carry_position(m, 2, **QUIET) == 80  # 40 per rank of 4 = 80 per rank of 2
    assert plan_resize(spec(), m, 4).old_world == 4


def test_a_written_data_world_wins_over_the_world_size(tmp_path):
    m = ckpt.read_meta(folder(tmp_path, {**TODAY, "world_size": 4, "data_world": 2}))  # tp 2: 2 data ranks
    assert (m.world_size, m.data_world) == (4, 2) and carry_position(m, 2, **QUIET) == 96


def test_before_layouts_were_recorded_no_layout_check(tmp_path):
    path = folder(tmp_path, without("parallel"))
    m = ckpt.read_meta(path)
    assert m.parallel is None
    check_same_layout(spec("--parallel.strategy", "zero2"), m, path)  # nothing to compare: no error


def test_the_fsdp_name_reads_as_zero3(tmp_path):
    path = folder(tmp_path, {**TODAY, "parallel": {"strategy": "fsdp", "tp": 1, "pp": 1}})
    m = ckpt.read_meta(path)
    assert m.parallel == {"strategy": "zero3", "tp": 1, "pp": 1}
    assert layout_of(spec("--parallel.strategy", "fsdp")) == {"strategy": "zero3", "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    check_same_layout(spec("--parallel.strategy", "zero3"), m, path)   # no cp / ep recorded: written at 1
    with pytest.raises(ConfigError, match=r"trained as zero3 \(tp 1, pp 1\), this spec asks for ddp"):
        check_same_layout(spec(), m, path)


def test_the_layout_names_cp_and_ep(tmp_path):
    path = folder(tmp_path, {**TODAY, "parallel": {"strategy": "ddp", "tp": 1, "pp": 1, "cp": 1, "ep": 2}})
    m = ckpt.read_meta(path)
    with pytest.raises(ConfigError, match=r"trained as ddp \(tp 1, pp 1, ep 2\), this spec asks for ddp "
                                          r"\(tp 1, pp 1\)") as e:
        check_same_layout(spec(), m, path)
    assert e.value.field == "parallel.ep" and "\n" not in str(e.value)


def test_before_on_resize_the_batch_is_the_configured_one(tmp_path):
    m = ckpt.read_meta(folder(tmp_path, {**without("data_world", "global_batch", "grad_accum"), "world_size": 2}))
    assert (m.global_batch, m.grad_accum) == (None, None)
    s = spec("--schedule.global_batch", "32", "--schedule.micro_batch", "8")
    rz = plan_resize(s, m, 1)
    assert (rz.old_world, rz.old_global, rz.old_accum, rz.accum, rz.global_batch) == (2, 32, 2, 4, 32)


def test_before_the_finished_check_a_rerun_trains(tmp_path):
    s = spec()
    done = CheckpointMeta.from_dict({**TODAY, "step": 40, "schedule_key": schedule_key(s)})
    assert finished(s, done)
    m = ckpt.read_meta(folder(tmp_path, {**without("total_steps", "schedule_key"), "step": 40}))
    assert (m.total_steps, m.schedule_key) == (None, None) and not finished(s, m)


def test_the_oldest_shape_loads(tmp_path):
    m = ckpt.read_meta(folder(tmp_path, without(*ONLY)))
    assert (m.consumed, m.data_world, m.grad_scaler, m.run_id, m.parallel) == (0, 2, None, None, None)
    assert carry_position(m, 2, **QUIET) == 0


def test_keys_of_a_later_version_are_left_out():
    assert CheckpointMeta.from_dict({**TODAY, "version": VERSION + 1, "new_field": 1}) == CheckpointMeta.from_dict(TODAY)


def test_a_meta_without_a_step_is_refused_by_name(tmp_path):
    path = folder(tmp_path, without("step"))
    with pytest.raises(CheckpointError, match="meta.json has no step") as e:
        ckpt.read_meta(path)
    assert e.value.value == str(path)
