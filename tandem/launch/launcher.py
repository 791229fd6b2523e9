"""The launcher: torchrun's elastic agent with tandem's logs, checks and failure summary.

    launch(opts, argv, run_dir)     runs `python argv...` on every worker of this node
                                    (or of K simulated nodes), blocks, raises WorkerFailure.

Rendezvous is torch's own: c10d (standalone on one node, or --rdzv-endpoint, or the
simulated nodes) or static (--master-addr/--master-port/--node-rank, like torchrun).
tandem adds what torchrun leaves to the user: a port check before node 0 binds, a
clear error when the master cannot be reached within the timeout, per-rank log files
named by global rank, the device/backend choice, and a root-cause summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from tandem.core.errors import ConfigError, JobStopped, LaunchError, WorkerFailure
from tandem.core import environment
from tandem.core.spec import LaunchSpec
from tandem.core.validate import node_counts
from tandem.launch import failures as fl
from tandem.launch import orphans
from tandem.core import rundir
from tandem.core.contract import ENV_BACKEND, ENV_DEVICE, ENV_RUN_DIR  # noqa: F401 (re-exported)

CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_device(opts: LaunchSpec) -> tuple[str, str]:
    """(device, backend) for this launch: the launcher decides, its workers inherit (tandem.core.environment)."""
    return environment.resolve_device(opts.device, opts.backend)


def _check_master_port(opts: LaunchSpec) -> None:
    """Node 0 of a static rendezvous binds master_port: say so clearly if it is taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((opts.master_addr if opts.master_addr not in ("localhost",) else "127.0.0.1",
                    opts.master_port))
        except OSError as e:
            raise LaunchError(f"master port {opts.master_port} on {opts.master_addr} is in use ({e.strerror})",
                              field="launch.master_port", value=opts.master_port,
                              fix="pick a free port with --master-port, or stop the process holding it "
                                  f"(`ss -ltnp | grep {opts.master_port}`)") from None


def _rendezvous(opts: LaunchSpec, store_hosted: bool = False) -> tuple[str, str, dict]:
    """(backend, endpoint, configs) as torchrun would choose them."""
    nodes = opts.nodes
    cfg: dict = {"timeout": opts.timeout_s, "join_timeout": opts.timeout_s}
    if nodes.elastic:  # elastic: notice a lost node in ~3 s; once MIN joined, wait last_call_s for more
        cfg.update(last_call_timeout=opts.last_call_s, keep_alive_interval=1, keep_alive_max_attempt=3)
    if opts.rdzv_endpoint:
        if store_hosted:  # the store lives elsewhere: no agent may try to host it
            cfg["is_host"] = False
        return "c10d", opts.rdzv_endpoint, cfg
    if nodes.max == 1:  # torchrun --standalone: a private c10d store on a free port
        return "c10d", f"127.0.0.1:{free_port()}", cfg
    cfg["rank"] = opts.node_rank
    if opts.node_rank == 0:
        _check_master_port(opts)
    return "static", f"{opts.master_addr}:{opts.master_port}", cfg


def _worker_env(opts: LaunchSpec, run_dir: Path, nodes_here: int) -> None:
    device, backend = resolve_device(opts)
    os.environ[ENV_DEVICE], os.environ[ENV_BACKEND] = device, backend
    os.environ[ENV_RUN_DIR] = str(run_dir.resolve())
    # Oversubscribed CPUs crawl: split the cores among the workers on this machine.
    threads = opts.threads_per_worker or max(1, (os.cpu_count() or 1) // (opts.nproc_per_node * nodes_here))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # torch 2.13 shares the agent's rendezvous store with the workers without a per-attempt key
    # prefix: after a restart, workers read the dead attempt's gloo addresses and barrier counts
    # (connection refused, or a hang). A fresh store on rank 0 for every attempt avoids it, but
    # its port is one the agent found free and closed, which rank 0 binds seconds later: another
    # process may take it first (EADDRINUSE). So only a group that can start again pays that race;
    # a single attempt joins the store the agent already holds open (torchrun's default).
    if multi_attempt(opts):
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:  # set per launch, not inherited: a test or an earlier agent in this process may have set it
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)


def multi_attempt(opts: LaunchSpec) -> bool:
    """Whether torchrun's agent may start this node's worker group more than once: a failure with
    restarts left (the hang watchdog's kill among them), or, in an elastic job (nnodes MIN:MAX), a
    node joining (``train.elastic.join``) or lost. With MIN == MAX a late node waits in torch's
    redundancy list, which ``num_nodes_waiting`` does not count, so it restarts no group."""
    return opts.max_restarts > 0 or opts.nodes.elastic


def run_agent(opts: LaunchSpec, argv: list[str], run_dir: Path, *, agent_index: int = 0,
              run_id: str | None = None, tee: bool = True, nodes_here: int = 1,
              store_hosted: bool = False, run_attempt: int = 1) -> None:
    """One torchrun elastic agent for this node; returns when its workers succeed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tandem.launch.logs import RankLogsSpecs

    nodes = opts.nodes
    backend, endpoint, rdzv_cfg = _rendezvous(opts, store_hosted)
    _worker_env(opts, run_dir, nodes_here)
    logs = RankLogsSpecs(run_dir, tee=tee, run_attempt=run_attempt)
    config = LaunchConfig(
        min_nodes=nodes.min, max_nodes=nodes.max, nproc_per_node=opts.nproc_per_node,
        logs_specs=logs, run_id=run_id or _run_id(opts, nodes.max),
        rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=rdzv_cfg,
        max_restarts=opts.max_restarts, monitor_interval=0.1, start_method="spawn",
        log_line_prefix_template="[rank${rank}]:", local_addr="127.0.0.1" if _is_local(opts) else None,
        # SIGINT is ours (_interrupts); a torch without this field handles all four itself (a second
        # Ctrl-C then waits for the workers' save like the first)
        **({"signals_to_handle": "SIGTERM,SIGHUP,SIGQUIT"}
           if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}),
    )
    t0 = time.monotonic()
    dog = start_watchdog(opts, run_dir, agent_index)
    restore = _interrupts(SignalException)
    try:
        # every worker through orphans.py: it dies with this agent, whatever ends the agent
        elastic_launch(config, entrypoint=sys.executable)(*orphans.wrap(argv))
    except ChildFailedError as e:
        failures = fl.from_child_failed(e, node=0, run_dir=run_dir, stderr_of=logs.stderr_of)
        for f in failures:  # static: the node rank is ours (nodes may differ in size); c10d: uniform sizes
            f.node = opts.node_rank if backend == "static" else f.rank // opts.nproc_per_node
        fl.write_node_failures(run_dir, agent_index, failures)
        raise WorkerFailure(fl.summarize(failures)) from None
    except SignalException as e:  # this agent was told to stop: torchrun has SIGTERMed its workers
        if e.sigval != signal.SIGINT and threading.current_thread() is threading.main_thread():
            # the workers have saved and exited; a second SIGTERM (srun --kill-on-bad-exit ends the other
            # nodes' tasks after the first exits 143) must not turn this exit into a traceback and exit 1
            signal.signal(e.sigval, signal.SIG_IGN)
        raise stopped(run_dir, e.sigval, time.time() - (time.monotonic() - t0)) from None
    except Exception as e:  # rendezvous/store errors: make them one readable line
        waited = time.monotonic() - t0
        text = f"{type(e).__name__}: {e}".splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if opts.node_rank != 0 or opts.rdzv_endpoint:
            raise LaunchError(f"could not join the rendezvous at {endpoint} within {waited:.0f} s ({text})",
                              field="launch.rdzv_endpoint" if opts.rdzv_endpoint else "launch.master_addr",
                              value=endpoint,
                              fix="check that node 0 is running and reachable (address, port, firewall), "
                                  "or raise --timeout") from None
        raise LaunchError(f"the rendezvous at {endpoint} failed ({text})", field="launch", value=endpoint,
                          fix="see the message above; run with --verbose for torch's logs") from None
    finally:
        restore()
        if dog is not None:
            dog.stop()


def _children() -> list[int]:
    """This process's child processes (Linux), the workers among them."""
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return pids


def _interrupts(signal_exception) -> Callable[[], None]:
    """Ctrl-C in this agent: the first asks for a graceful stop (torchrun passes SIGINT on to the
    workers, which save at an agreed step); a second means now. torchrun's own handler cannot
    tell them apart: its second SignalException, raised inside its wait for the workers, lands in
    a ``finally`` that waits for them again (30 s, with SIGTERM), and the workers save anyway.
    So SIGINT is ours (``LaunchConfig.signals_to_handle`` leaves it out): the first raises torchrun's SignalException as its handler would, the
    second sends SIGINT to the workers again, which exit at once without a checkpoint (stop.py),
    and torchrun's wait ends with them. Returns what undoes it."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    told = []

    def on_sigint(signum, frame):
        told.append(signum)
        if len(told) == 1:
            raise signal_exception(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)
        for pid in _children():
            try:
                os.killpg(pid, signal.SIGINT)  # torchrun starts each worker in a session of its own
            except OSError:
                pass

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    return lambda: signal.signal(signal.SIGINT, old_handler)


def stopped(run_dir: Path, signum: int, since: float) -> JobStopped:
    """What to tell a user whose job was stopped by a signal: the checkpoint the workers saved
    on the way out (a tandem train job, elastic.save_on_term), read from the run's metrics."""
    name = signal.Signals(signum).name
    saved = None
    try:
        recs = [r for r in rundir.read_metrics(run_dir) if r["time"] >= since]
        last_start = max((i for i, r in enumerate(recs) if r["kind"] == "start"), default=-1)
        # the workers' last start only: an earlier attempt's stop (a join) is not this one
        saved = next((r for r in recs[last_start + 1:] if r["kind"] == "stop"), None)
    except (OSError, ValueError, KeyError):
        pass
    if saved and saved.get("checkpoint"):
        return JobStopped(f"stopped by {name}: the workers saved {Path(saved['checkpoint']).name} at step "
                          f"{saved['step']} on the way out", signum=signum,
                          fix="run the same command again: it resumes from that checkpoint")
    return JobStopped(f"stopped by {name}", signum=signum)


def start_watchdog(opts: LaunchSpec, run_dir: Path, node: int):
    """The hang watchdog thread of this agent (launch.watchdog_s > 0), see watchdog.py."""
    if not opts.watchdog_s:
        return None
    from tandem.launch.watchdog import Watchdog

    dog = Watchdog(run_dir, opts.watchdog_s, node=node)
    dog.start()
    return dog


def _run_id(opts: LaunchSpec, max_nodes: int) -> str:
    """One node: a fresh id. Several nodes started separately must agree on it (the
    rendezvous keys are prefixed by it), as torchrun's default rdzv_id does."""
    return uuid.uuid4().hex[:12] if max_nodes == 1 else "tandem"


def _is_local(opts: LaunchSpec) -> bool:
    host = (opts.rdzv_endpoint.rsplit(":", 1)[0] if opts.rdzv_endpoint else opts.master_addr)
    return host in ("127.0.0.1", "localhost")


def quiet_cpp_logs(verbose: bool) -> None:
    """Load torch with its C++ log level at FATAL in this process, unless --verbose or the user set one.

    c10d's TCPStore logs every retry of an unreachable master straight to stderr from C++, with
    stack frames (30-80 lines before our one-line error). That level is read once, when libtorch
    loads, so it is set around the import and removed after: the workers keep the user's level."""
    if verbose or CPP_LOG_ENV in os.environ or "torch" in sys.modules:
        return
    os.environ[CPP_LOG_ENV] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ[CPP_LOG_ENV]


def quiet_torch_logs(verbose: bool) -> None:
    """Our summary replaces torch's warnings. torch's elastic modules give each of their loggers
    its own level when imported (``elastic.utils.logging.get_logger``), so setting the parent's is
    not enough: import them first, then set every one of them."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    level = logging.INFO if verbose else logging.CRITICAL
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    for name in [n for n in logging.Logger.manager.loggerDict if n.startswith(prefixes)] + list(prefixes):
        logging.getLogger(name).setLevel(level)


def launch(opts: LaunchSpec, argv: list[str], run_dir: Path, *, quiet: bool = False,
           on_poll: Callable[[], None] | None = None, verbose: bool = False, attempt: int | None = None) -> None:
    """Run ``python argv...`` on every worker; raise WorkerFailure/LaunchError on failure.

    ``quiet`` keeps worker output in the per-rank files only (no console stream);
    ``on_poll`` is called about every 0.2 s while simulated nodes run (progress bars);
    ``attempt``: this start of the run dir (`tandem train` records it); None: record one here.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in (run_dir / rundir.FAILURES).glob("node-*.json"):
        old.unlink()
    if argv and argv[0].endswith(".py") and not Path(argv[0]).is_file():
        raise ConfigError("script not found", field="script", value=argv[0], fix="give the path of a Python file")
    if attempt is None and opts.node_rank and not opts.simulate_nodes:
        # another node of a static multi-node job (Slurm, a TrainJob's pods), often on a shared run
        # dir: node 0 records the start, the other nodes log under its number (read once it exists)
        attempt = rundir.NODE0_ATTEMPT
    if attempt is None:
        attempt = rundir.begin_attempt(run_dir)["attempt"]
    quiet_cpp_logs(verbose)  # before anything loads torch
    quiet_torch_logs(verbose)
    if not opts.simulate_nodes:
        run_agent(opts, argv, run_dir, agent_index=opts.node_rank, tee=not quiet, run_attempt=attempt)
        return
    _simulate(opts, argv, run_dir, quiet=quiet, on_poll=on_poll, verbose=verbose, attempt=attempt)


def _simulate(opts: LaunchSpec, argv: list[str], run_dir: Path, *, quiet: bool,
              on_poll: Callable[[], None] | None, verbose: bool, attempt: int) -> None:
    """K real torchrun agents on this machine, joined by one c10d rendezvous."""
    from torch.distributed import TCPStore

    k = opts.simulate_nodes
    # torch's own TCPStore, hosted here like a dedicated rendezvous host on a cluster:
    # then no agent's exit takes the store away from the others.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    run_id = uuid.uuid4().hex[:12]
    cfg_dir = run_dir / rundir.LAUNCH
    cfg_dir.mkdir(parents=True, exist_ok=True)
    nodes = node_counts(opts)  # elastic: MIN:K
    procs = []
    for i in range(k):
        node_opts = dataclasses.replace(opts, simulate_nodes=0, nnodes=str(nodes), node_rank=i,
                                        rdzv_endpoint=endpoint)
        cfg = cfg_dir / f"node-{i}.json"
        cfg.write_text(json.dumps({"opts": dataclasses.asdict(node_opts), "argv": argv, "run_dir": str(run_dir),
                                   "run_id": run_id, "agent_index": i, "nodes_here": k, "tee": not quiet, "store_hosted": True,
                                   "verbose": verbose, "run_attempt": attempt, "parent_pid": os.getpid()}))
        # Own process groups: a Ctrl-C in the terminal reaches this process only, which passes it
        # on once to each agent (an agent told twice cuts short its workers' graceful stop).
        procs.append(subprocess.Popen([sys.executable, "-m", "tandem.launch.node", str(cfg)], process_group=0))
    t0, told = time.time(), []

    def forward(signum, frame):  # each node's agent stops its workers (they checkpoint), then exits
        told.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    main = threading.current_thread() is threading.main_thread()  # only there may handlers be set
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        while any(p.poll() is None for p in procs):
            if on_poll:
                on_poll()
            time.sleep(0.2)  # polling our own children's exit codes, not waiting on a peer
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.returncode for p in procs]
    if told and any(codes):  # a signal after every node finished changes nothing
        raise stopped(run_dir, told[0], t0)
    by_signal = [c - 128 for c in codes if c and c > 128 and c - 128 in signal.valid_signals()]
    if by_signal and len(by_signal) == sum(1 for c in codes if c):  # the agents were signalled, not us
        raise stopped(run_dir, by_signal[0], t0)
    del store
    if on_poll:
        on_poll()
    if any(codes) and nodes.elastic and codes.count(0) >= nodes.min:
        lost = [i for i, c in enumerate(codes) if c]
        print(f"tandem: simulated node(s) {lost} lost (exit codes {[codes[i] for i in lost]}); the elastic job "
              f"finished on the {codes.count(0)} other(s)", file=sys.stderr, flush=True)
        return
    if any(codes):
        failures = fl.read_failures(run_dir)
        if not failures:
            raise LaunchError(f"simulated node agents exited with codes {codes} before starting workers",
                              field="launch.simulate_nodes", value=k, fix="see the agents' messages above")
        raise WorkerFailure(fl.summarize(failures))
