"""`tandem submit`: hand a job to the engine the user already runs (Slurm, Kubernetes, ssh hosts, Ray).

One interface (backend.py) that every engine implements, one record of what was submitted
(record.py, RUN_DIR/submit/job.json), and a registry from ``--on NAME`` to the engine
(registry.py). The engines: slurm.py, k8s.py (manifests in k8s_manifests.py), ssh.py
(ssh_plan.py, ssh_run.py), ray_driver.py (ray_worker.py runs inside Ray's workers).
What each node runs is `tandem launch` or `tandem train`; the node-side entries the engines
name in their commands are ``-m tandem.launch.slurm_env`` (the launch stage's) and
``-m tandem.cli.ssh_remote`` (an entry of the command line, like ``python -m tandem``).
"""
