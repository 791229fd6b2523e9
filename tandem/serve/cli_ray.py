"""`--engine ray` checks, run before anything starts: ray importable, --address answering, and the
flags the Ray engine does not take; and the Ray Serve deployment options tandem's flags map onto
(plain data, built without Ray, so the mapping is tested without a cluster)."""

from __future__ import annotations

import math

from tandem.core.errors import ConfigError


def deployment_options(opts, nodes: int) -> dict:
    """``serve.deployment(...).options(**this)`` for a PoolOptions on a cluster of ``nodes``.

    A fixed ``--replicas N`` is ``num_replicas=N``. ``--replicas MIN:MAX`` hands the decisions to Ray
    Serve's autoscaler: ``autoscaling_config`` with MIN..MAX replicas (starting at MIN), a target of
    ``--scale-up-queue`` ongoing requests per replica (0: --max-batch, as on the local engine), and
    --scale-up-s / --scale-down-s as its upscale / downscale delays. Replicas are spread: at most
    ceil(N or MAX / nodes) on one node."""
    sc = opts.scale
    most = sc.max_replicas if sc else opts.replicas
    out = {"max_replicas_per_node": math.ceil(most / max(1, nodes)),
           "max_ongoing_requests": max(8, 2 * opts.max_batch), "health_check_period_s": 2,
           "health_check_timeout_s": max(10.0, opts.hang_s), "ray_actor_options": {"num_cpus": 1}}
    if sc is None:
        return out | {"num_replicas": opts.replicas}
    # a replica may hold max_ongoing_requests; a target above it could never be reached
    target = min(sc.up_queue, out["max_ongoing_requests"])
    return out | {"num_replicas": "auto", "autoscaling_config": {
        "min_replicas": sc.min_replicas, "initial_replicas": sc.min_replicas, "max_replicas": sc.max_replicas,
        "target_ongoing_requests": target, "upscale_delay_s": sc.up_s, "downscale_delay_s": sc.down_s}}


def ray_pool_factory(address: str | None, replicas: str, scale_up_p99_ms: float = 0.0):
    """A ``make_pool(opts, metrics, say)`` for cli._serve, or ConfigError (exit 2)."""
    from tandem.serve import ray_engine  # sets Ray's environment before Ray is imported

    if ray_engine.serve is None:
        try:
            import ray.serve  # noqa: F401 (only for the reason it fails)
            e = "ray.serve did not import"
        except ImportError as err:
            e = err
        raise ConfigError(f"Ray Serve is not installed ({e})", field="--engine", value="ray",
                          fix="pip install 'tandem[ray]' (the `ray` extra: ray[serve,train]), or use --engine "
                              "local") from None
    if scale_up_p99_ms:   # Ray Serve's autoscaler scales on ongoing requests only
        raise ConfigError("p99 autoscaling is the local engine's", field="--scale-up-p99-ms",
                          value=scale_up_p99_ms, fix="leave it out with --engine ray (--replicas MIN:MAX scales "
                                                     "on ongoing requests there), or use --engine local")
    from tandem.core.ray_address import check_ray_address
    from tandem.serve.ray_engine import RayPool

    check_ray_address(address)

    def make_pool(opts, metrics, say=print):
        return RayPool(opts, metrics, say=say, address=address)
    return make_pool
