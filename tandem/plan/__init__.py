"""`tandem plan`: a cost model and strategy search for memory, communication, compute, time and cost.

hardware.py  GPU / link presets, cluster file      model.py    parameters, FLOPs, activation formulas
config.py    Training and Strategy dataclasses     measure.py  meta-device measurement of an nn.Module
memory.py    memory per GPU (ZeRO 0-3, Korthikanti) comm.py     ring / hierarchical collective times
cost.py      one strategy -> Plan                  search.py   enumerate, rank, explain near misses
explain.py   sentences with the arithmetic         report.py   JSON (stable keys) and rich table
calibration.py  measured links / FLOP/s            plot.py     PNG of step time and memory
Formulas and sources: docs/plan.md.
"""

from tandem.plan.config import Strategy, Training
from tandem.plan.cost import Plan, evaluate, validate
from tandem.plan.hardware import make_cluster
from tandem.plan.model import GPTShape, gpt_stats, params_only, preset

__all__ = ["Strategy", "Training", "Plan", "evaluate", "validate", "make_cluster", "GPTShape", "gpt_stats",
           "params_only", "preset"]
