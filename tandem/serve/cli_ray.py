"""`--engine ray` checks, run before anything starts: ray importable, --address answering, and the
flags the Ray engine does not take."""

from __future__ import annotations

from tandem.core.errors import ConfigError


def ray_pool_factory(address: str | None, replicas: str):
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
    if ":" in replicas:
        raise ConfigError("--replicas MIN:MAX (autoscaling) is the local engine's", field="--replicas",
                          value=replicas, fix="give a fixed --replicas N with --engine ray")
    from tandem.serve.ray_engine import RayPool, check_address

    check_address(address)

    def make_pool(opts, metrics, say=print):
        return RayPool(opts, metrics, say=say, address=address)
    return make_pool
