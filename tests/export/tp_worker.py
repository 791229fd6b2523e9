"""Run on each rank of a 2-process gloo group (harness.numerics.spawn): the full export put
through tandem's own training tp plan (DTensor) must hold, on rank R, exactly the tensors of the
export's tp-R-of-2/ folder, and give the full model's outputs."""

from __future__ import annotations


def check_slices(export_dir: str, ctx) -> dict:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tandem.export import load
    from tandem.train.parallel.tp import apply_tp

    x = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = load(export_dir)(x)
        model = load(export_dir)
        apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False,
                 loss_parallel=False)
        mine = load_file(f"{export_dir}/tp-{ctx.rank}-of-2/model.safetensors")
        local = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
        out = model(x)
    return {"names": sorted(local) == sorted(mine),
            "mismatched": [n for n in sorted(local) if not torch.equal(local[n], mine[n])],
            "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)
                              and p.placements[0].is_shard()),
            "max_diff": (out - ref).abs().max().item()}
