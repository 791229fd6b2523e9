"""The job spec: typed sections, each field documented.

A spec is loaded from TOML or YAML (``load_spec``), patched by dotted overrides
from the command line (``--optim.lr 0.2``), and validated before any process
starts (``validate``). Unknown keys are errors. Field help strings live in
``metadata["help"]`` so that ``tandem spec`` and the README can print them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.core.noderange import NodeRange


def f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help string (the field's docstring)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelSpec:
    name: str = f("resnet18", "resnet18 | resnet34 | resnet50 | gpt (a GPT decoder, sized by the gpt: fields "
                              "below) | llama (a Llama-style decoder: rotary positions, RMSNorm, SwiGLU, "
                              "grouped-query attention, no biases; the gpt: fields and the llama: ones; "
                              "docs/models.md) | hf:DIR (a local Hugging Face checkpoint folder, config.json + safetensors: "
                              "Llama, Qwen2, Qwen3, Mistral or GPT-2, built as tandem's llama or gpt with the shape "
                              "fields from its config.json and its weights loaded shard by shard under any strategy; "
                              "docs/export.md), or an import path 'pkg.module:factory' returning an nn.Module (called "
                              "with the fields of this section its signature names, num_classes= and "
                              "in_channels= among them, and with any key of this section tandem does not "
                              "know, see extra; the module found as the workers find it: PYTHONPATH, then "
                              "the working directory).")
    width: int = f(64, "Channels of the first ResNet stage (64 in the paper); smaller for CPU runs.")
    num_classes: int = f(10, "Number of output classes.")
    in_channels: int = f(3, "Input image channels (digits: 1).")
    small_input: bool = f(False, "CIFAR-style stem (3x3 conv, stride 1, no max-pool) for inputs under 64 px.")
    channels_last: bool = f(True, "NHWC memory format for image models under bf16/fp16 autocast: oneDNN's and "
                                  "cuDNN's fast path (10x faster under bf16 on this CPU). fp32 stays NCHW: "
                                  "torch 2.13's CPU NHWC fp32 convolutions corrupt memory below 8 channels.")
    sync_bn: bool = f(False, "Convert BatchNorm to SyncBatchNorm (GPU only; torch's SyncBatchNorm refuses CPU).")
    layers: int = f(2, "gpt: transformer blocks.")
    hidden: int = f(64, "gpt: model width (hidden size).")
    heads: int = f(4, "gpt: attention heads (divides hidden; tp divides heads).")
    kv_heads: int = f(0, "gpt: key/value heads for grouped-query attention (0: same as heads).")
    ffn: int = f(0, "gpt: MLP inner size (0: 4 x hidden; llama: 8/3 x hidden rounded up to a multiple of 256).")
    seq: int = f(16, "gpt: sequence length (the reverse/sort tasks use seq/2 digits).")
    vocab: int = f(16, "gpt: vocabulary size (the digit tasks need at least 11).")
    tied: bool = f(True, "gpt: output layer shares the token embedding matrix (refused with pp > 1).")
    gelu: str = f("exact", "gpt: the MLP's gelu: exact (erf) | tanh (the tanh approximation, GPT-2's gelu_new; "
                           "set by an hf: GPT-2 checkpoint).")
    head_dim: int = f(0, "llama: features per attention head (0: hidden / heads; Qwen3 sets it apart).")
    rope_theta: float = f(10000.0, "llama: rotary base (10000 Llama 2, 500000 Llama 3, 1000000 Qwen).")
    rope_scaling: dict = f({}, "llama: rotary scaling, Hugging Face's rope_scaling keys: {} (none) | {rope_type = "
                               "\"linear\", factor = F} | {rope_type = \"llama3\", factor = 8.0, low_freq_factor "
                               "= 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192} (left-out "
                               "keys take these values); on the command line as JSON.")
    norm_eps: float = f(1e-5, "llama: RMSNorm epsilon (1e-5 Llama, 1e-6 Qwen).")
    qkv_bias: bool = f(False, "llama: biases on the query, key and value projections (Qwen2).")
    qk_norm: bool = f(False, "llama: RMSNorm on each head's queries and keys before the rotation (Qwen3).")
    experts: int = f(0, "llama: routed experts per block, a mixture of experts in place of the SwiGLU MLP (0: dense; "
                        "tandem/models/moe.py, docs/models.md).")
    top_k: int = f(2, "llama MoE: experts each token is routed to (token choice, 1 <= top_k <= experts).")
    shared_experts: int = f(0, "llama MoE: always-active experts every token also runs (DeepSeek's shared experts).")
    expert_ffn: int = f(0, "llama MoE: each expert's SwiGLU inner size (0: model.ffn's).")
    capacity_factor: float = f(1.25, "llama MoE: an expert takes at most ceil(capacity_factor x tokens x top_k / "
                                     "experts) tokens of a micro-batch; the rest are dropped (their residual passes).")
    router_aux_loss: float = f(0.01, "llama MoE: load-balance loss coefficient (Switch: experts x sum of fraction "
                                     "routed x mean router probability), added to the loss per MoE block; 0: off.")
    router_z_loss: float = f(0.0, "llama MoE: router z-loss coefficient (ST-MoE: mean squared log-sum-exp of the "
                                  "router logits); 0: off.")
    loss: str = f("cross_entropy", "The training loss, a sum over the micro-batch: cross_entropy (class labels "
                                   "or token targets, -100 ignored) | model (the model returns its loss, a mean "
                                   "over the targets, as a tensor, a dict with 'loss' or an object with .loss: a "
                                   "forward naming input_ids and labels, like a transformers causal LM, is called "
                                   "model(input_ids=x, labels=[-100, y[:-1]]), labels aligned with the input as it "
                                   "shifts them itself, so its loss is the same next-token loss (transformers: "
                                   "plus shift_labels=y, every target scored); any other forward: model(x, y), y "
                                   "the targets as given) | 'pkg.module:fn' with fn(output, target) returning the "
                                   "SUMMED loss. See tandem/train/loss.py.")
    hf: dict = f({}, "Set by model.name = 'hf:DIR' (leave it out): {path, architecture, config}, the Hugging "
                     "Face folder the initial weights are read from, its architecture and the config.json keys "
                     "tandem does not model (carried into tandem export --format hf).")
    extra: dict = f({}, "A factory's own keywords (width of an MLP, depth, dropout...): with model.name "
                        "'pkg.module:factory', any key of the model section tandem does not know lands here and is passed "
                        "to the factory; checked against its signature before launch (a typo gets 'did you "
                        "mean'). For the built-in models an unknown key is an error.")


@dataclass
class DataSpec:
    name: str = f("digits", "digits (scikit-learn's bundled 8x8 handwritten digits) | synthetic (Gaussian "
                            "images, labels from a random linear teacher) | npz (your arrays, see path) | "
                            "reverse | sort (token tasks for gpt: reverse or sort a string of digits) | "
                            "tokens (next-token windows of model.seq + 1 from a folder written by tandem data "
                            "prepare-text, see path) | an import path 'pkg.module:factory' returning (train, "
                            "held_out) map-style Datasets of (x, y) tensors (docs/data.md).")
    path: str = f("", "For name=npz: a .npz file with arrays x (N,C,H,W) and y (N,); for name=tokens: the "
                      "folder of tandem data prepare-text; passed to your own factory as path=.")
    image_size: int = f(8, "Side of the square input images (digits are resized from 8 when different).")
    num_samples: int = f(2048, "For name=synthetic, reverse and sort: number of samples (held-out ones included); "
                               "for tokens: held-out windows scored per evaluation, spread over the held-out "
                               "split (0: all).")
    held_out: float = f(0.2, "Fraction of the set kept out of training for evaluation (0 disables eval); tokens: "
                             "the split is the folder's (prepare-text --held-out), 0 disables eval.")
    remainder: str = f("pad", "When the train set does not divide by world size: 'pad' repeats the first "
                              "few shuffled samples so every rank gets as many (every sample at least once, "
                              "pad count logged); 'drop' leaves the last few shuffled samples out of that "
                              "epoch (every kept sample exactly once).")
    shuffle: bool = f(True, "Shuffle the train set each epoch (seeded by schedule.seed + epoch).")
    num_workers: int = f(0, "DataLoader worker processes per rank.")


@dataclass
class ParallelSpec:
    strategy: str = f("ddp", "Data-parallel strategy: ddp | zero1 (ZeroRedundancyOptimizer: optimizer state "
                             "sharded) | zero2 (FSDP2, no reshard after forward: +gradients) | zero3 / fsdp "
                             "(FSDP2 full shard: +parameters) | hsdp (shard inside a node, replicate across). "
                             "See docs/parallel.md.")
    tp: int = f(1, "Tensor-parallel degree (gpt only; innermost mesh dimension, kept inside a node).")
    pp: int = f(1, "Pipeline-parallel degree (gpt only): ranks that each hold a slice of the layers.")
    cp: int = f(1, "Context-parallel degree (gpt, llama): ranks that split each sequence (2 x cp load-balanced "
                   "chunks, ring attention); they read the same batch. See docs/parallel.md.")
    ep: int = f(1, "Expert-parallel degree (llama with model.experts): carved out of dp, each ep group splits the "
                   "experts; tokens go to their experts by all-to-all. See docs/parallel.md.")
    dp_shard: int = f(0, "hsdp: ranks one shard group spans (0: the data-parallel ranks of one node).")
    sequence_parallel: bool = f(False, "tp: shard norms and dropout along the sequence too (Korthikanti 2022).")
    loss_parallel: bool = f(True, "tp: keep logits sharded over the vocabulary and compute the loss in place.")
    pp_schedule: str = f("1f1b", "pp schedule: gpipe | 1f1b | interleaved (interleaved 1F1B, pp_virtual "
                                 "stages per rank). Micro-batches per step = global_batch / (dp x micro_batch).")
    pp_virtual: int = f(2, "interleaved: model chunks (stages) per pipeline rank.")
    pp_split: str = f("cost", "Layers to stages: cost (balanced by estimated FLOPs, head and embedding "
                              "included) | even (equal layer counts).")
    activation_checkpoint: str = f("none", "none | selective (every ac_every-th block) | full (every block).")
    ac_every: int = f(2, "selective activation checkpointing: checkpoint one block in this many.")
    compile: bool = f(False, "torch.compile each block after tp and checkpointing, before data-parallel wrapping.")
    comm_hook: str = f("none", "ddp gradient compression: none | fp16 | bf16 | powersgd.")
    powersgd_rank: int = f(2, "comm_hook=powersgd: rank of the low-rank gradient approximation.")
    local_sgd_every: int = f(0, "Local SGD: average the models every H steps instead of every step (0: off; "
                                "ddp only).")
    local_sgd_warmup: int = f(0, "Post-local SGD: plain ddp for this many steps before local SGD starts.")
    bucket_cap_mb: float = f(25.0, "DDP gradient bucket size in MiB: larger buckets, fewer all-reduce calls.")
    gradient_as_bucket_view: bool = f(True, "Let gradients alias DDP's buckets (saves one gradient copy).")
    static_graph: bool = f(False, "Tell DDP the graph is the same every step (enables more overlap).")
    find_unused_parameters: bool = f(False, "Search for parameters without gradients each step (slow; "
                                            "only for models with conditional branches).")


@dataclass
class OptimSpec:
    name: str = f("sgd", "sgd | adamw.")
    lr: float = f(0.1, "Learning rate at the reference batch (see ref_batch).")
    ref_batch: int = f(256, "Linear scaling rule: effective lr = lr * global_batch / ref_batch. 0 turns it off.")
    momentum: float = f(0.9, "SGD momentum.")
    nesterov: bool = f(False, "SGD Nesterov momentum.")
    weight_decay: float = f(5e-4, "Weight decay.")
    betas: list = f([0.9, 0.999], "AdamW betas.")
    clip_grad_norm: float = f(0.0, "Clip the gradient to this global 2-norm (over all shards and pipeline "
                                   "stages, after fp16 unscaling) before each step; 0: off. The norm before "
                                   "clipping is logged as grad_norm in every step record either way.")


@dataclass
class ScheduleSpec:
    global_batch: int = f(256, "Samples per optimizer step, all workers together.")
    micro_batch: int = f(64, "Samples per worker per forward/backward; "
                             "accumulation steps = global_batch / (workers x micro_batch).")
    epochs: int = f(1, "Passes over the train set.")
    max_steps: int = f(0, "Stop after this many optimizer steps (0: run all epochs).")
    warmup_steps: int = f(0, "Linear warm-up from 0 to the effective lr over this many steps.")
    decay: str = f("cosine", "After warm-up: cosine | linear | constant.")
    min_lr_ratio: float = f(0.0, "Floor of the decay, as a fraction of the effective lr.")
    seed: int = f(0, "Seed for weights, shuffling and every RNG (deterministic on CPU).")
    log_every: int = f(10, "Print a progress line on rank 0 every N steps.")


@dataclass
class PrecisionSpec:
    dtype: str = f("fp32", "fp32 | bf16 (autocast, CPU and GPU) | fp16 (autocast + GradScaler, CPU and GPU: "
                           "a step whose gradient overflows is skipped on every rank and the scale halved).")


@dataclass
class CheckpointSpec:
    dir: str = f("", "Checkpoint folder (default: <run_dir>/checkpoints).")
    every_steps: int = f(0, "Save every N optimizer steps (0: only at the end).")
    at_end: bool = f(True, "Save once more after the last step.")
    keep_last: int = f(2, "Keep the newest K complete checkpoints; older ones are deleted after a save.")
    resume: str = f("auto", "auto (newest complete checkpoint in dir, if any) | none | a checkpoint path.")
    async_save: bool = f(False, "Write checkpoints with dcp.async_save in a background thread: training blocks "
                                "only while the state is copied; published when every rank finished writing.")


@dataclass
class LaunchSpec:
    nproc_per_node: int = f(1, "Worker processes per node (GPUs per node on a GPU machine).")
    nnodes: str = f("1", "Number of nodes, or MIN:MAX for elastic jobs.")
    node_rank: int = f(0, "This node's rank (static rendezvous with master_addr/master_port).")
    master_addr: str = f("127.0.0.1", "Address of node 0 (static rendezvous).")
    master_port: int = f(29500, "Port on node 0 for the rendezvous store.")
    rdzv_endpoint: str = f("", "host:port of a c10d rendezvous (instead of master_addr/port; needed "
                               "for elastic MIN:MAX).")
    simulate_nodes: int = f(0, "Run K real torchrun agents on this machine joined by c10d rendezvous.")
    max_restarts: int = f(0, "Restarts of the whole worker group after a failure.")
    timeout_s: int = f(60, "Seconds to wait for the rendezvous (an unreachable master fails after this).")
    device: str = f("auto", "auto (cuda if available, else cpu) | cpu | cuda.")
    backend: str = f("auto", "auto (nccl on cuda, gloo on cpu) | gloo | nccl.")
    threads_per_worker: int = f(0, "torch intra-op threads per worker (0: cores / workers on this node).")
    run_dir: str = f("runs/{name}", "Where logs, metrics and checkpoints go; {name} is the job name.")
    watchdog_s: float = f(0, "Hang watchdog: a rank without training progress for this many seconds gets its "
                             "stacks dumped and the group is ended (restarted with max_restarts). 0: off.")
    last_call_s: int = f(3, "Elastic MIN:MAX: seconds the rendezvous waits for more nodes once MIN joined.")

    @property
    def nodes(self) -> NodeRange:
        """``nnodes`` as numbers (validate_launch refused any text that does not parse, naming the
        field as the user wrote it). Derived from the text each time: a caller may replace ``nnodes``."""
        return NodeRange.parse(self.nnodes)


@dataclass
class ElasticSpec:
    straggler_every: int = f(50, "Compare per-rank data-wait (and record busy) times every N steps (0: off).")
    straggler_ratio: float = f(1.5, "A rank whose data wait exceeds this times the median of the others, two "
                                    "windows in a row, is named a straggler.")
    straggler_min_ms: float = f(10.0, "...and by at least this many milliseconds per step (no alarms on noise).")
    on_resize: str = f("keep_batch", "When the data-parallel world changes (elastic nnodes MIN:MAX): keep_batch "
                                     "keeps the global batch (gradient accumulation adjusts, LR unchanged) | "
                                     "scale_lr keeps micro_batch and accumulation, so the global batch follows "
                                     "the world and the LR follows it by the linear scaling rule (x new/old "
                                     "global batch, Goyal et al. 2017); the schedule goes on from the same point, "
                                     "counted in samples (max_steps then counts steps of the configured batch).")
    save_on_term: bool = f(True, "On SIGTERM (torchrun restarting the group for a joining node, a scheduler "
                                 "preempting the job or draining a node), every rank agrees on one step through "
                                 "the step's loss all-reduce, saves a checkpoint there and exits: the restart redoes "
                                 "no step. false: a SIGTERM ends the rank at once, as by default.")
    term_grace_s: float = f(10.0, "...unless, after the SIGTERM, no step finishes for this many seconds (saves and "
                                  "evaluation not counted: a peer is gone or stuck): then the rank exits with code "
                                  "143 without saving, before torchrun's SIGKILL at 30 s.")
    join: bool = f(False, "tandem train on a node that joins an elastic job already running (same run_dir, "
                          "rdzv_endpoint and nnodes MIN:MAX): keep the run's spec.json, metrics and result "
                          "instead of starting a new run; the running nodes restart at the larger world.")


@dataclass
class ProfileSpec:
    enabled: bool = f(False, "Profile a window of steps on every rank (torch.profiler, CPU activity always, CUDA where "
                             "present) into RUN_DIR/profile/rank-R/; read it with `tandem diagnose RUN_DIR`.")
    start_step: int = f(5, "First profiled step (1-based, as in metrics.jsonl); the step before it warms the "
                           "profiler up. Early steps pay for warm-up, so not 1 unless the run is that short.")
    steps: int = f(3, "Steps in the window. Outside it the trainer's phase markers cost a flag test.")
    record_shapes: bool = f(True, "Record tensor shapes: gives each collective's size (DDP's bucket sizes).")
    clock_rounds: int = f(5, "Barriers at the window's start whose exit times align the ranks' clocks.")
    memory: bool = f(True, "Run the step after the window under torch's MemTracker (on CUDA: the allocator's "
                           "history, a memory snapshot): peak memory by category (parameters, gradients, "
                           "activations, optimizer state, temporaries). That step runs slower; it is not in the "
                           "window.")
    nvtx: bool = f(True, "On CUDA, also mark the trainer's phases as NVTX ranges (Nsight Systems shows the same "
                         "names), for the whole run, not only the window.")


@dataclass
class JobSpec:
    name: str = f("job", "Job name (used in run_dir).")
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    profile: ProfileSpec = field(default_factory=ProfileSpec)


SECTIONS = {f.name: f.type for f in dataclasses.fields(JobSpec) if f.name != "name"}
