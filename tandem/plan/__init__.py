"""`tandem plan`: a cost model and strategy search for memory, communication, compute, time and cost.

Layers, each importing only the ones before it:
inputs/   what a plan is computed from: hardware.py (GPU / link presets, cluster file), calibration.py (measured
          links and FLOP/s), host_model.py, model.py (dense and MoE shapes, presets), measure.py (an nn.Module on the
          meta device), training.py (Training, Strategy and their modes), args.py (command-line values -> these)
terms/    each cost term, numbers only: memory, efficiency / attention_kernels / gemm / bandwidth_bound (compute),
          stages (pipeline pace and bubble), data_parallel, tensor_parallel, pipeline, context, expert (communication)
          over collectives and nccl_algos, with params, grad_sync, fsdp_copies, dp_overlap
cost.py   the composer: one strategy -> Plan            search.py  enumerate, rank, explain near misses
explain*.py  sentences with the arithmetic               report.py  JSON (stable keys) and rich table
units.py  number formatting (every layer may use it)    plot.py    PNG of step time and memory
Formulas and sources: docs/plan.md.
"""

from tandem.plan.cost import Plan, evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats, params_only, preset
from tandem.plan.inputs.training import Strategy, Training

__all__ = ["Strategy", "Training", "Plan", "evaluate", "validate", "make_cluster", "GPTShape", "gpt_stats",
           "params_only", "preset"]
