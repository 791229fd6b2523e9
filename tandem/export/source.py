"""The checkpoint an export reads: found, verified, described, and read a few tensors at a time.

Input is a run dir (its ``checkpoints/latest``) or a checkpoint folder written by ``tandem train``
(see tandem/train/checkpoint.py). Its sha256 manifest is checked before anything else. The model
is described by the run's ``spec.json`` (model section) and by DCP's ``.metadata``: global shapes
and dtypes of every ``model.*`` entry, whatever layout (ddp, zero, tp, pp) saved it.

Tensors are read with a partial ``dcp.load`` of just the keys asked for, in this process, with no
process group: DCP assembles each from the shards (FSDP chunks, tp slices, pipeline ranks) into
a tensor of the global shape. The metadata is unpickled once and reused for every read.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.core.errors import CheckpointError, ConfigError, TandemError
from tandem.train import checkpoint as ckpt
from tandem.train import checkpoint_meta, manifest
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.core import rundir


class ExportIOError(TandemError):
    """Reading the checkpoint or writing the export failed (disk full, permissions): exit 1."""

    exit_code = 1


FIELD = "checkpoint"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


@dataclass
class Source:
    path: Path                       # the checkpoint folder
    run_dir: Path | None
    meta: CheckpointMeta             # meta.json
    spec: dict                       # the job spec (spec.json), as a dict
    spec_path: Path | None
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)  # model entries
    _metadata: object = None

    @property
    def step(self) -> int:
        return self.meta.step

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """These model tensors (names without the ``model.`` prefix), full global shape, on the CPU."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        md = self._metadata

        class Reader(FileSystemReader):
            def read_metadata(self, *a, **k):  # parsed once by Source.open
                return md

        state = {f"model.{n}": torch.empty(self.tensors[n][1], dtype=self.tensors[n][0]) for n in names}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=Reader(str(self.path)), no_dist=True)
        except OSError as e:
            raise ExportIOError(f"cannot read the checkpoint ({type(e).__name__}: {e})", field=FIELD,
                                value=str(self.path), fix="check the files are readable") from e
        except Exception as e:  # a shard whose bytes do not unpickle: altered without a manifest
            raise CheckpointError(f"cannot read {', '.join(names[:3])} from the checkpoint "
                                  f"({type(e).__name__}: {str(e)[:200]})", field=FIELD, value=str(self.path),
                                  fix="export an earlier checkpoint that verifies") from e
        return {n: state[f"model.{n}"] for n in names}


def find_checkpoint(path: Path) -> tuple[Path, Path | None]:
    """(checkpoint folder, run dir or None) for a run dir or a checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError("no such file or folder", field=FIELD, value=str(path),
                              fix="give a run dir (runs/<job>) or a checkpoint folder (runs/<job>/checkpoints/step-N)")
    if (path / ".metadata").is_file() or (path / "meta.json").is_file():
        run = path.parent.parent if path.parent.name == rundir.CHECKPOINTS else None
        return path, run if run is not None and (run / rundir.SPEC).is_file() else None
    if (path / rundir.SPEC).is_file():
        spec = json.loads((path / rundir.SPEC).read_text())
        cdir = Path(spec.get("checkpoint", {}).get("dir") or path / rundir.CHECKPOINTS)
        found = _newest(cdir)
        if found is None:
            raise CheckpointError("the run has no complete checkpoint that matches its manifest", field=FIELD,
                                  value=str(path), fix="train with checkpoints on (checkpoint.at_end = true) "
                                                       "or give a checkpoint folder")
        return found, path
    raise CheckpointError("not a checkpoint (no .metadata or meta.json) nor a run dir (no spec.json)",
                          field=FIELD, value=str(path),
                          fix="give a run dir (runs/<job>) or a checkpoint folder (runs/<job>/checkpoints/step-N)")


def _newest(cdir: Path) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one. Unlike a resume, no silent fallback
    past one that fails its manifest: open_source refuses it by name."""
    pointer = cdir / "latest"
    if pointer.is_file() and ckpt.is_complete(p := cdir / pointer.read_text().strip()):
        return p
    found = ckpt.list_complete(cdir)
    return found[-1] if found else None


def open_source(path: Path, spec_path: Path | None = None) -> Source:
    """Find, verify (manifest first) and describe the checkpoint; nothing is written."""
    folder, run = find_checkpoint(path)
    if not ckpt.is_complete(folder):
        missing = [n for n in (".metadata", "meta.json") if not (folder / n).is_file()]
        raise CheckpointError(f"incomplete checkpoint (missing {', '.join(missing)})", field=FIELD,
                              value=str(folder), fix="export an earlier, complete checkpoint")
    bad = manifest.problem(folder)
    if bad:
        raise CheckpointError(f"checkpoint {folder.name} failed its sha256 manifest: {bad}", field=FIELD,
                              value=str(folder), fix="export an earlier checkpoint that verifies")
    meta = checkpoint_meta.read(folder)
    spec_file = Path(spec_path) if spec_path else (run / rundir.SPEC if run else None)
    if spec_file is None or not spec_file.is_file():
        raise ConfigError("no job spec for this checkpoint (no spec.json in its run dir)", field="--spec",
                          value=str(spec_file or folder),
                          fix="give the run dir, or --spec with the run's spec.json / job spec")
    spec = _read_spec(spec_file)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"unreadable DCP metadata ({type(e).__name__})", field=FIELD, value=str(folder),
                              fix="export an earlier checkpoint that verifies") from e
    tensors = {k[len("model."):]: (v.properties.dtype, tuple(v.size))
               for k, v in md.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError("the checkpoint holds no model tensors", field=FIELD, value=str(folder),
                              fix="give a checkpoint written by tandem train")
    return Source(folder, run, meta, spec, spec_file, tensors, md)


def _read_spec(path: Path) -> dict:
    """A spec.json (resolved spec) or a job spec file (TOML/YAML), as a dict with every section."""
    from tandem.core.config import from_dict, load_spec, to_dict

    try:
        if path.suffix == ".json":
            return to_dict(from_dict(json.loads(path.read_text())))
        return to_dict(load_spec(path, check=False))
    except json.JSONDecodeError as e:
        raise ConfigError(f"unreadable spec ({e})", field="--spec", value=str(path),
                          fix="give the run's spec.json") from e


def spec_sha256(src: Source) -> str:
    return _sha(src.spec_path) if src.spec_path else ""


def manifest_sha256(src: Source) -> str:
    return _sha(src.path / manifest.NAME)
