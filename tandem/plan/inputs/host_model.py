"""A model measured on this host (`tandem bench train`, calibration ``compute.model``) and what
workers sharing the host's CPU cores do to it.

The calibration row is one worker. Predicting N workers of the same job from it:

- rate: the model's achieved FLOP/s on that worker (its whole step: forward, backward,
  optimizer, data; so efficiency is 1) replaces datasheet peak x efficiency;
- core share (CPU only): W busy threads on C cores next to B other runnable threads get
  C / max(C, W + B) of a core each. Relative to the calibration run (T_cal threads):
  slowdown = max(C, N*T + B) / max(C, T_cal + B), never below 1 per worker thread
  that had its own core. B is the mean of /proc/stat procs_running sampled during the
  calibration run, less the worker's own threads and the sampler;
- stragglers: a synchronous step ends when the slowest of N ranks does. With per-rank
  step times distributed as the calibration run's steps, the median over steps of the
  max of N independent draws is the quantile 0.5**(1/N) (P(max <= x) = F(x)**N); the
  factor is that quantile over the median. It is 1 for one worker and ~1 on quiet GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import ConfigError


def _pos(d: dict, key: str, *, zero_ok: bool = False) -> float:
    v = d.get(key)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
    if not ok:
        need = "a number >= 0" if zero_ok else "a positive number"
        raise ConfigError(f"compute.model.{key} must be {need}", field="calibration", value=v,
                          fix="re-run `tandem bench train` or correct the file")
    return float(v)


@dataclass(frozen=True)
class ModelCalibration:
    name: str
    precision: str
    flops_per_sample: float       # the planner's model FLOPs of one training sample when measured
    achieved_flops: float         # model FLOPs per step / median step time, one worker
    threads: int                  # intra-op threads of that worker
    cores: int                    # logical CPUs of the host
    background: float             # other runnable threads on the host during the run (mean)
    step_samples: tuple[float, ...]  # steady-state step times of the run, sorted (seconds)
    device: str = "cpu"

    @classmethod
    def from_doc(cls, d: dict, device: str) -> "ModelCalibration":
        if not isinstance(d, dict):
            raise ConfigError("compute.model must be an object", field="calibration", value=d,
                              fix="re-run `tandem bench train` or correct the file")
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError("compute.model.name must be a model name", field="calibration", value=name,
                              fix="re-run `tandem bench train` or correct the file")
        samples = d.get("step_samples_s") or [d.get("step_s")]
        if not isinstance(samples, list) or not samples:
            raise ConfigError("compute.model.step_samples_s must be a list of seconds", field="calibration",
                              value=samples, fix="re-run `tandem bench train` or correct the file")
        for s in samples:
            _pos({"step_samples_s": s}, "step_samples_s")
        return cls(name=name, precision=str(d.get("precision") or "fp32"),
                   flops_per_sample=_pos(d, "flops_per_sample"), achieved_flops=_pos(d, "achieved_flops"),
                   threads=int(_pos(d, "threads_per_worker")), cores=int(_pos(d, "cores")),
                   background=_pos(d, "background_threads", zero_ok=True),
                   step_samples=tuple(sorted(float(s) for s in samples)), device=device)

    def matches(self, name: str, flops_per_sample: float | None, precision: str) -> bool:
        """The same model (name and FLOPs within 1%) at the same precision: else the number says nothing."""
        return (name == self.name and precision == self.precision and bool(flops_per_sample)
                and abs(flops_per_sample / self.flops_per_sample - 1) < 0.01)

    def core_slowdown(self, workers: int, threads: int) -> float:
        """How much slower each of `workers` workers (x `threads`) runs than the calibration worker."""
        if self.device != "cpu":
            return 1.0
        c, b = self.cores, self.background
        return max(c, workers * threads + b) / max(c, self.threads + b)

    def quantile(self, q: float) -> float:
        """Empirical quantile (linear interpolation between order statistics)."""
        xs = self.step_samples
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def straggler_factor(self, ranks: int) -> float:
        """Median of the max of `ranks` draws over the median of one draw (1 for one rank)."""
        if ranks <= 1:
            return 1.0
        return self.quantile(0.5 ** (1.0 / ranks)) / self.quantile(0.5)


def default_threads(cores: int, workers_per_node: int) -> int:
    """The launcher's default intra-op threads per worker (tandem/launch/launcher.py)."""
    return max(1, cores // max(1, workers_per_node))
