"""A checkpoint's ``meta.json``: what the run was when it saved, typed and versioned.

One writer (``CheckpointMeta.to_json``, called when a checkpoint is published) and one reader
(``read``, through ``from_dict``): a resume, the rerun checks of `tandem train`, an export and a
restarted group's search for its own checkpoint all get a ``CheckpointMeta``. Checkpoints written
by earlier versions carry fewer keys, or older names; ``from_dict`` upgrades them here, and only
here, so no reader needs a fallback of its own.

Versions: 1 is every ``meta.json`` without a ``version`` key (what tandem wrote before this file,
the older shapes included: no ``data_world``, ``parallel``, ``global_batch``/``grad_accum``,
``total_steps``/``schedule_key``, ``consumed``); 2 adds ``version``; ``example_input`` came later
within version 2 (a reader without it gets None: the export falls back to what the spec implies).
The keys keep their names: other tools read the JSON as it is.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.errors import CheckpointError

VERSION = 2
FILE = "meta.json"


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    step: int                           # optimizer steps done
    epoch: int
    consumed: int = 0                   # samples each data rank consumed in ``epoch``
    world_size: int | None = None       # processes that saved (rank r's RNG state is rng-rank<r>.pt)
    data_world: int | None = None       # data-parallel ranks: the unit of ``consumed``
    global_batch: int | None = None     # None: before elastic.on_resize, the configured one
    grad_accum: int | None = None       # None: before elastic.on_resize, derived from the global batch
    scheduler: dict = field(default_factory=dict)     # Schedule.state_dict()
    grad_scaler: dict | None = None     # fp16 only
    model: str | None = None            # model.name
    signature: dict = field(default_factory=dict)     # parameter name -> shape (check_compatible)
    job: str | None = None              # the spec's name
    parallel: dict | None = None        # {"strategy", "tp", "pp", "cp", "ep"} (resume.layout_of); None: not recorded
    total_steps: int | None = None      # the run's length when it saved
    schedule_key: dict | None = None    # the spec fields that decide that length (resume.schedule_key)
    run_id: str | None = None           # TORCHELASTIC_RUN_ID of the run that saved (a restart finds its own)
    example_input: dict | None = None   # one train sample's x as a batch of one (input_record); None: older
    version: int = VERSION

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        if d["grad_scaler"] is None:  # as before versions: the key only where a scaler ran
            del d["grad_scaler"]
        if d["example_input"] is None:  # recorded by the trainer; absent from metas made by hand and older runs
            del d["example_input"]
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, raw: dict, where: str | None = None) -> CheckpointMeta:
        """Any version's keys -> this version's fields (keys a later version added are left out).
        ``where``: the checkpoint folder, named by the error for a meta.json without a step."""
        d = dict(raw)
        version = d.pop("version", 1)
        if version < 2:
            # before tp/pp every rank was a data rank: the world size was the data world
            d.setdefault("data_world", d.get("world_size"))
            layout = d.get("parallel")
            if layout and layout.get("strategy") == "fsdp":  # zero3's alias, recorded as the spec wrote it
                d["parallel"] = {**layout, "strategy": "zero3"}
        missing = [k for k in ("step", "epoch") if k not in d]
        if missing:
            raise CheckpointError(f"{FILE} has no {' or '.join(missing)}", field="checkpoint.resume", value=where,
                                  fix="resume from a checkpoint written by tandem train")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def input_record(x, vocab: int | None = None) -> dict:
    """What an export needs to run the model without the data: ``{"shape": [1, *x.shape], "dtype"}``,
    and for integer inputs (token ids, category codes) ``high``: the data's vocabulary where it knows
    one (a token folder's tokenizer), else one past the largest value seen."""
    dtype = str(x.dtype).removeprefix("torch.")
    rec = {"shape": [1, *map(int, x.shape)], "dtype": dtype}
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        rec["high"] = int(vocab) if vocab else int(x.max()) + 1 if x.numel() else 1
    return rec


def read(folder: Path) -> CheckpointMeta:
    """The checkpoint folder's meta.json (no other check: checkpoint.read_meta verifies the folder first)."""
    return CheckpointMeta.from_dict(json.loads((Path(folder) / FILE).read_text()), str(folder))


def write(folder: Path, meta: CheckpointMeta) -> None:
    (Path(folder) / FILE).write_text(meta.to_json())
