"""The optimizer steps a run trains: one count for the trainer and for `tandem plan --config`.

Both need the same arithmetic (a rank's share of the training set, the remainder policy, whole
steps for pipeline schedules, epochs and max_steps); it lives here, below both, so the plan's
"N steps" is the trainer's."""

from __future__ import annotations

from tandem.core.spec import JobSpec

DIGITS_SAMPLES = 1797  # sklearn's load_digits()


def held_out_count(n: int, frac: float) -> int:
    """Samples kept out of training: at least one on each side when a held-out set is asked for."""
    if frac <= 0:
        return 0
    return min(max(1, round(n * frac)), n - 1)


def rank_epoch_len(train_samples: int, data_ranks: int, drop_last: bool, per_step: int, whole_steps: bool) -> int:
    """Samples one data rank trains per epoch: torch's DistributedSampler share (pad: rounded up,
    drop: rounded down), less the tail that does not fill a step when the schedule needs whole steps
    (pipeline stages keep static shapes)."""
    n = train_samples // data_ranks if drop_last else -(-train_samples // data_ranks)
    return n - n % per_step if whole_steps else n


def steps_per_epoch(epoch_len: int, per_step: int) -> int:
    """Optimizer steps of an epoch: the last one may be short."""
    return -(-epoch_len // per_step)


def total_steps(epochs: int, per_epoch: int, max_steps: int) -> int:
    """Optimizer steps of the whole run: all epochs, or max_steps when it is set and fewer."""
    return min(max_steps, epochs * per_epoch) if max_steps else epochs * per_epoch


def train_samples(spec: JobSpec) -> int | None:
    """The training set's size where the spec alone says it (the built-in generated sets and
    digits); None for data read from files or built by your own factory."""
    d = spec.data
    if d.name in ("reverse", "sort", "synthetic"):
        return d.num_samples - held_out_count(d.num_samples, d.held_out)
    if d.name == "digits":
        return DIGITS_SAMPLES - held_out_count(DIGITS_SAMPLES, d.held_out)
    return None


def planned_steps(spec: JobSpec, world: int, tp: int = 0, pp: int = 0, global_batch: int = 0,
                  micro_batch: int = 0) -> int | None:
    """The steps `tandem train` will run for the spec at ``world`` workers (the layout and batch
    the spec gives unless named here; no resize, no resume), or None when the training set's size
    is known only once it is loaded and the spec sets no max_steps."""
    s, p = spec.schedule, spec.parallel
    tp, pp = tp or p.tp, pp or p.pp
    global_batch, micro_batch = global_batch or s.global_batch, micro_batch or s.micro_batch
    n = train_samples(spec)
    data_ranks = max(1, world // (tp * pp))
    per_rank = data_ranks * micro_batch
    if n is None or global_batch % per_rank:
        return s.max_steps or None
    per_step = micro_batch * (global_batch // per_rank)
    epoch_len = rank_epoch_len(n, data_ranks, spec.data.remainder == "drop", per_step, pp > 1)
    return total_steps(s.epochs, steps_per_epoch(epoch_len, per_step), s.max_steps)
