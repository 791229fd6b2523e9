"""Pure checks of the parallel layer: degrees and their errors, mesh coordinates, pipeline split,
the GPT and its tasks. No processes."""

import pytest
import torch

from tandem.core.errors import ConfigError
from tandem.core.spec import JobSpec
from tandem.core.validate import validate
from tandem.models.gpt import GPTConfig, block_cost, gpt
from tandem.core.dims import from_spec
from tandem.train.parallel.pp import balanced_split, split_layers
from tandem.train.tasks import IGNORE, make_task, token_accuracy


def gpt_spec(world=4, **par) -> JobSpec:
    s = JobSpec()
    s.model.name, s.model.layers, s.model.hidden, s.model.heads, s.model.seq = "gpt", 4, 32, 4, 8
    s.model.tied = par.get("pp", 1) == 1
    s.data.name = "reverse"
    s.schedule.global_batch, s.schedule.micro_batch = 32, 2
    s.launch.nproc_per_node = world
    for k, v in par.items():
        setattr(s.parallel, k, v)
    return s


def test_degrees_and_coords():
    d = from_spec(gpt_spec(8, tp=2, pp=2), 8)
    assert (d.pp, d.dp, d.tp) == (2, 2, 2)
    # tp innermost, then dp, then pp
    assert d.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    assert d.coords(1)["tp"] == 1 and d.coords(2)["dp"] == 1 and d.coords(4)["pp"] == 1
    h = from_spec(gpt_spec(4, strategy="hsdp"), 4, local_world=2)
    assert (h.dp_replicate, h.dp_shard) == (2, 2)


@pytest.mark.parametrize("par,model,needle", [
    (dict(tp=3), {}, "tp 3 x pp 1 = 3 does not divide the world size 4 (4 % 3 = 1)"),
    (dict(tp=4), dict(heads=2, hidden=32), "heads 2 is not divisible by tp 4 (2 % 4 = 2)"),
    (dict(tp=2), dict(kv_heads=1), "kv_heads 1 is not divisible by tp 2"),
    (dict(pp=4, pp_split="even"), dict(layers=6), "layers 6 do not split evenly into pp 4 x 1 chunk(s) = 4 stages"),
    (dict(pp=2), dict(tied=True), "tied embeddings"),
    (dict(pp=4), dict(layers=2), "layers 2 < pp 4 x 1 chunk(s) = 4 stages"),
    (dict(tp=2), dict(name="resnet18"), "model 'resnet18' has none"),
    (dict(strategy="zero1", tp=2), {}, "zero1 (ZeroRedundancyOptimizer) takes plain tensors"),
    (dict(comm_hook="fp16", strategy="zero3"), {}, "comm_hook works on DDP's gradient buckets"),
    (dict(strategy="hsdp", dp_shard=3), {}, "dp_shard 3 does not divide dp 4"),
])
def test_bad_degrees_show_arithmetic(par, model, needle):
    s = gpt_spec(4, **par)
    for k, v in model.items():
        setattr(s.model, k, v)
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert needle in str(e.value), str(e.value)
    assert "Fix:" in str(e.value)


def test_fewer_microbatches_than_stages_refused_up_front():
    s = gpt_spec(4, pp=4)
    s.schedule.global_batch, s.schedule.micro_batch = 16, 8   # dp 1: 2 micro-batches < 4 stages
    with pytest.raises(ConfigError, match=r"2 micro-batch\(es\) per step .* < pp 4 stages"):
        validate(s)
    s = gpt_spec(4, pp=2, pp_schedule="interleaved")
    s.schedule.global_batch, s.schedule.micro_batch = 12, 2    # dp 2: 3 micro-batches, not a multiple of 2
    with pytest.raises(ConfigError, match="rounds of pp 2; 3 % 2 = 1"):
        validate(s)


def test_tp_across_nodes_warns():
    s = gpt_spec(4, tp=4)
    s.launch.nproc_per_node = 2
    with pytest.warns(UserWarning, match="tp 4 spans more than one node"):
        from_spec(s, 4, local_world=2)


def test_balanced_split_by_cost():
    # equal blocks, an expensive head: the last stage gets fewer blocks
    assert balanced_split([1.0] * 8, 2, last=2.0) == [0, 5]
    assert balanced_split([1.0] * 8, 4) == [0, 2, 4, 6]
    c = GPTConfig(layers=8, hidden=64, heads=4, seq=16, vocab=8192, tied=False)
    m = gpt(layers=8, hidden=64, heads=4, seq=16, vocab=8192, tied=False)
    parts = split_layers(m, 2, "cost")
    assert [len(p) for p in parts] == [7, 1]          # head = 2*64*8192 FLOPs/token ~ 10 blocks
    assert block_cost(c, "head") > 10 * block_cost(c, "block")
    assert [len(p) for p in split_layers(m, 2, "even")] == [4, 4]


def test_gpt_shapes_gqa_and_tied():
    m = gpt(layers=2, hidden=32, heads=4, kv_heads=2, seq=8, vocab=16)
    assert m.head.weight is m.tok_emb.weight
    assert m.layers["0"].attn.wk.weight.shape == (16, 32)
    x, y = make_task("reverse", 5, 8, 0)
    assert m(x).shape == (5, 8, 16)
    # reverse: the answer is the prompt backwards; the prompt is not scored
    assert (y[:, :4] == IGNORE).all() and torch.equal(y[:, 4:], x[:, :4].flip(1))
    xs, ys = make_task("sort", 3, 8, 1)
    assert torch.equal(ys[:, 4:], xs[:, :4].sort(1).values)
    c, n = token_accuracy(torch.nn.functional.one_hot(y.clamp(min=0), 16).float(), y)
    assert c == n == 5 * 4


def test_the_pipeline_stage_hook_the_moe_router_losses_rely_on_exists():
    # pp.RouterLosses tells torch's first-step shape inference from a micro-batch by wrapping this method
    # (torch 2.13): a torch without it would count the inference forward as micro-batch 0
    from torch.distributed.pipelining import PipelineStage

    from tandem.train.parallel.pp import _Stage

    assert callable(getattr(PipelineStage, "_forward_metadata_inference", None))
    assert "_forward_metadata_inference" in vars(_Stage)
