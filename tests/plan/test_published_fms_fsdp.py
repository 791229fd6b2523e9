"""Throughput against a fifth publication, FSDP and HSDP on 128 A100s: IBM's fms-fsdp (foundation-model-stack/
fms-fsdp, README.md at commit 0d319983, the table "Training Throughput (128 GPUs)"; the same runs as the PyTorch
blog "Maximizing training throughput using PyTorch FSDP", IBM and Meta, 2024-03-13). Llama 2 7B/13B/70B and the
34B shape (Code Llama 34B: 48 layers, hidden 8192, 64 heads, 8 KV heads, ffn 22016), sequence 4096, bf16,
SDPA flash attention, token/gpu/sec as the expected number.

The planner gets each row's shape, 128 A100-80GB (16 nodes of 8), the sharding strategy (HSDP as --zero 3
--hsdp: shard inside a node, replicate across; FSDP as --zero 3 over all 128), the per-GPU batch as the
micro-batch, activation checkpointing True as full recompute (the README's selective_checkpointing default of 1
checkpoints every block), AdamW and its default efficiency: nothing fitted. The interconnect: "128 A100 GPUs with
400Gbps network connectivity and GPU direct RDMA" (the PyTorch blog's Training Details; the README's later table
headers say "A100 80G 128 GPUs with 400Gbps"): 2 x RoCE 200 Gb/s a node (4 x 100 gives the same rates). Until
session 8 the test assumed 8 x HDR 200 (1.6 Tb/s): 13B +27.1% then, +25.8% at 400 Gb/s.

KNOWN MISS (issue 14 asks 10% median, 25% max). On main when written: median 20.5%, max 31.1%; after the achievable
link rates and the per-architecture attention factor: 23.1% / 32.9% (7B -10.4%, 13B +4.5%, 34B -31.1%, 70B
-30.7%: the full-recompute rows slow). With the per-architecture compute model (efficiency.py: A100 linear layers
at 0.67 of peak, from the FlashAttention-2 paper's end-to-end runs; nothing fitted to this table): median 12.5%,
max 34.9%: 7B +15%, 13B +35%, 34B -10%, 70B -9%. The full-recompute rows now pass; the 13B row (HSDP, one
sample of 4096 tokens a GPU) ran at 40% MFU against the 7B row's 48% and is predicted FAST: a per-GPU batch of
one sequence keeps the GEMMs large (M = 4096 tokens), so neither the roofline nor the measured GEMM shapes slow
it. Term at fault: not found (HSDP's replica all-reduce and FSDP's exposed traffic are under 2% here, asserted).
With the memory-bound ops charged (bandwidth_bound.py, --kernels eager: the README's runs predate fms-fsdp's
torch.compile work (a later PyTorch blog, "Maximizing training throughput using PyTorch FSDP and
Torch.compile"); RMSNorm, SwiGLU, rotary and the loss as eager kernels, foreach
AdamW) and the A100 linear share re-derived without them (0.71): median 9.2%, max 26.6% (7B +8.8%, 13B +26.6%,
34B -9.6%, 70B -8.2%): the median now within the tolerance, the 13B row still fast.
Attention: PyTorch SDPA's flash backend, FlashAttention-2 (attention_kernel "fa2"; fms-fsdp calls
F.scaled_dot_product_attention). With the attention-kernel model (FlashAttention-2 at its own 0.615 of A100 peak
at 2048, by length; it ran at 0.515 before): median 13.6%, max 38.9% (7B +19%, 13B +39%, 34B -8%, 70B -7.5%):
faster rows, the 13B miss larger; pinned just above.

With both the memory-bound ops and the attention-kernel model, as merged: median 9.8%, max 29.1% (7B +11.5%,
13B +29.1%, 34B -8.1%, 70B -7.0%): KNOWN MISS on the max, pinned at 10% / 30%; the 13B row (40% MFU published
against 7B's 48%) is still not explained.
With FSDP1's own copies timed (fsdp_copies.py, fsdp="fsdp1": fms-fsdp wraps the model in FullyShardedDataParallel,
use_orig_params only with compile; backward concatenates the flat parameter's views' gradients, 4 B per unsharded
parameter per micro-batch, and pre-divides the unsharded gradient before each reduce-scatter, hidden with it) and
the blog's 400 Gb/s a node: median 9.2%, max 25.8% (7B +9.9%, 13B +25.8%, 34B -8.5%, 70B -7.3%): KNOWN MISS on the
max by 0.8 points, pinned at 10% / 26%. HSDP's replica all-reduce of the 13B row (3.25 GB a GPU across 16 nodes,
1.03 s at 400 Gb/s) now nearly fills its 1.2 s backward; its exposed communication is 2.0% of the step (was under
1% at 1.6 Tb/s; asserted under 3%). Not modelled, and each a candidate for the rest: fms's RMSNorm upcasts to fp32
(fms/modules/layernorm.py, use_high_precision_pow=True in fms's LLaMA block, as Meta's and HF's RMSNorm do): counted
op by op through autograd as 18 passes forward and 46 backward a norm where the planner's eager RMSNorm has 7 and 18,
it gives median 10.4%, max 21.3% (7B +5.1%, 13B +21.3%, 34B -11.2%, 70B -9.6%): the miss moves from the max to the
median, and torchtitan's eager rows move with it, so it was not adopted in this change; NCCL kernels slowing the
GEMMs they overlap (no source with a figure read); the step's two host syncs (loss.item(), clip_grad_norm_().item()).

INPUT AUDIT (session 9): the 13B row's inputs checked against fms-fsdp at the README's commit 0d319983, nothing
to change: batch 1 a GPU, HSDP (sharding_strategy "hsdp" = ShardingStrategy.HYBRID_SHARD, fms_fsdp/utils/
train_utils.py get_policies), activation checkpointing False (so selective_checkpointing, the every-k-th-block
ratio of policies/ac_handler.py, is not applied), seq_length 4096 (config/training.py), use_torch_compile False
(scripts/train.sh; docs/configurations.md: "recommended to NOT use compile at this stage"), mixed precision
bfSixteen (FSDP MixedPrecision: param, reduce and buffer dtype bf16, no autocast: bf16 gathers and reduction as
planned), FullyShardedDataParallel with use_orig_params = compile (False), limit_all_gathers True, FSDP1's default
BACKWARD_PRE prefetch, torch AdamW, unfused torch CrossEntropyLoss on the full logits (as --kernels eager),
clip_grad_norm_().item() and loss.item() every step, Llama 2 13B shape (vocab 32000, 40 x 5120, 40 heads, ffn
13824: MHA, as planned). The README gives no MFU; the PyTorch blog's own table was not found in the stored pages,
so its row for 13B was not compared. Finding for the 34B/70B rows (not adopted): at 0d319983 get_model_config
builds "34b" and "70b" without kvheads, which fms's LLaMA reads as kvheads = nheads (MHA: 39.4B / 78.4B
parameters); "align with FMS config" (247f22c, same day, not an ancestor of 0d319983) adds kvheads=8. Planned MHA,
34B / 70B move from -8.5% / -7.3% to -20.6% / -17.7% (median 19.2%); the later README's MFU column (0.55 for
34B/70B with compile) fits GQA better than MHA (0.62), and the runs predate both commits, so GQA is kept."""

from statistics import median

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

LLAMA2 = dict(gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False, vocab=32000, seq=4096)
SHAPES = {
    "7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, **LLAMA2),
    "13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, **LLAMA2),
    "34b": dict(layers=48, hidden=8192, heads=64, kv_heads=8, ffn=22016, **LLAMA2),
    "70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, **LLAMA2),
}
# Model Size, Sharding Strategy HSDP?, Activation Checkpointing, Batch Size (per GPU), token/gpu/sec
ROWS = [("7b", True, False, 2, 3760), ("13b", True, False, 1, 1700), ("34b", False, True, 8, 772),
        ("70b", False, True, 6, 380)]
KNOWN_MISS = (0.10, 0.26)   # (median, max) pinned: see KNOWN MISS above


def errors() -> dict[str, float]:
    out = {}
    for name, hsdp, ckpt, batch, tps in ROWS:
        m = gpt_stats(GPTShape(**SHAPES[name]), f"llama2-{name}")
        c = make_cluster("a100-80gb", 8, 16, inter="roce-200", nics_per_node=2)
        t = Training(global_batch=batch * 128, precision="bf16", optimizer="adamw", attention_kernel="fa2",
                     kernels="eager", fsdp="fsdp1")
        s = Strategy(dp=128, zero=3, hsdp=hsdp, micro_batch=batch, recompute="full" if ckpt else "none",
                     ranks_per_node=8)
        validate(m, c, t, s)
        p = evaluate(m, c, t, s)
        assert p.memory.fits, (name, p.memory.total / 2**30)   # they ran
        exposed = sum(o.exposed_s for o in p.comm)
        assert exposed < 0.03 * p.step_s, (name, exposed, p.step_s)   # the miss is not communication
        out[name] = batch * 4096 / p.step_s / tps - 1
    return out


def test_tokens_per_gpu_known_miss():
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= KNOWN_MISS[0], errs
    assert max(errs.values()) <= KNOWN_MISS[1], errs


def test_rows_but_13b_within_the_issue_tolerance():
    e = errors()
    assert all(abs(e[k]) <= 0.25 for k in ("7b", "34b", "70b")), e
    assert abs(e["13b"]) <= 0.26, e   # known miss, see above
