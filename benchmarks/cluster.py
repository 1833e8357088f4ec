"""Seconds per gradient exchange on an emulated Ethernet cluster: hvdcomp next to Horovod and torch DDP.

Builds ``--nodes`` network namespaces behind one switch, every link shaped by tc to each ``--rates`` rate
(``cluster_netns``), and runs every scheme (``cluster_schemes``) in fresh worker processes inside them
(``cluster_worker``): Horovod Gloo workers through Horovod's own rendezvous server, as ``horovod.ray``
starts them, or torch.distributed Gloo workers (DDP with its own hooks or hvdcomp's, Birder), as torchrun
starts them. A scheme whose workers do not start within ``--startup-timeout`` seconds, or then finish no
step for ``--stall-timeout`` seconds, is reported as a hang, one whose worker fails as an error; the run
goes on. Needs root.

    python benchmarks/cluster.py --quick
    python benchmarks/cluster.py --nodes 2 --workers-per-node 1 --rates 1gbit,10gbit --reps 3 \\
        --json runs/cluster.json --plot runs/cluster.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cluster_report
from cluster_netns import INTERFACE, Cluster, parse_rate, remove_stale, why_unavailable
from cluster_schemes import QUICK, default_schemes, parse_scheme

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
DDP_PORT = 29500  # + the scheme's index: rank 0's TCP store for DDP schemes
KILL_GRACE_S = 3.0
ERROR_LINE = re.compile(r"Error|Exception|what\(\)|terminate called|Aborted")
MESSAGE_LINE = re.compile(r"what\(\):|\w+(Error|Exception): ")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line -> options; ``--quick`` fills in what was not given (2 x 1 nodes, 1gbit, the 2M model,
    a few schemes). Bad rates, schemes or shapes exit with a usage error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nodes", type=int, help="node namespaces (default 2)")
    parser.add_argument("--workers-per-node", type=int, help="workers in each node (default 1)")
    parser.add_argument("--rates", help="comma-separated link rates in tc units (default 1gbit)")
    parser.add_argument("--delay", help="one-way netem delay per direction of each link, e.g. 1ms (default none)")
    parser.add_argument("--model", choices=("resnet50", "vgg16", "small", "quick"),
                        help="resnet50 (23.52M, default), vgg16 (14.7M), small (30K), quick (1.95M, the first "
                             "ResNet-50 stages)")
    parser.add_argument("--schemes", help="comma-separated scheme names (default: all; see cluster_schemes.py)")
    parser.add_argument("--reps", type=int, help="timed steps per scheme (default 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps before them (default 3; 2 with --quick)")
    parser.add_argument("--threads", type=int, help="torch threads per worker (default: cores / workers, >= 1)")
    parser.add_argument("--stall-timeout", type=float,
                        help="seconds without a step finished before a scheme counts as hung (default 120)")
    parser.add_argument("--startup-timeout", type=float,
                        help="seconds for the workers to start (imports, model, init) before a hang (default 300)")
    parser.add_argument("--logs", help="keep every scheme's worker logs under LOGS/<rate>/<scheme>/")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--plot", help="write a PNG of seconds per exchange against link rate here")
    parser.add_argument("--quick", action="store_true",
                        help="2 nodes x 1 worker, 1gbit, the quick model, a few schemes, 2 warm-up steps")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"nodes": 2, "workers_per_node": 1, "rates": "1gbit", "model": "quick" if quick else "resnet50",
                "reps": 3, "warmup": 2 if quick else 3, "stall_timeout": 120.0, "startup_timeout": 300.0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if (args.nodes < 2 or args.workers_per_node < 1 or args.reps < 1 or args.warmup < 0 or args.stall_timeout <= 0
            or args.startup_timeout <= 0):
        parser.error("need --nodes >= 2, --workers-per-node >= 1, --reps >= 1, --warmup >= 0 and positive timeouts")
    try:
        args.rate_list = [(rate.strip(), parse_rate(rate)) for rate in args.rates.split(",")]
        names = args.schemes.split(",") if args.schemes else (list(QUICK) if quick
                                                              else default_schemes(args.workers_per_node))
        args.scheme_list = [parse_scheme(name).name for name in names]
    except ValueError as error:
        parser.error(str(error))
    workers = args.nodes * args.workers_per_node
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // workers)
    return args


def horovod_env(cluster: Cluster, args: argparse.Namespace, node: int, local: int, port: int) -> dict[str, str]:
    """Horovod's per-worker variables, as ``horovod.runner.gloo_run`` / ``horovod.ray`` set them."""
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.address(0), "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": INTERFACE,
            "HOROVOD_HOSTNAME": cluster.node_name(node), "HOROVOD_RANK": str(node * args.workers_per_node + local),
            "HOROVOD_SIZE": str(cluster.nodes * args.workers_per_node), "HOROVOD_LOCAL_RANK": str(local),
            "HOROVOD_LOCAL_SIZE": str(args.workers_per_node), "HOROVOD_CROSS_RANK": str(node),
            "HOROVOD_CROSS_SIZE": str(cluster.nodes)}


def _ddp_env(cluster: Cluster, args: argparse.Namespace, node: int, local: int) -> dict[str, str]:
    """torch.distributed's per-worker variables, as torchrun sets them: ranks node by node, and the node's
    ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` (what ``TorchDistributedTransport`` reads for hierarchical exchanges)."""
    return {"RANK": str(node * args.workers_per_node + local), "WORLD_SIZE": str(cluster.nodes * args.workers_per_node),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(args.workers_per_node), "GLOO_SOCKET_IFNAME": INTERFACE}


def start_rendezvous(cluster: Cluster, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """Horovod's rendezvous server in node 0's namespace; returns it and its port."""
    hosts = ",".join(f"{cluster.node_name(i)}:{args.workers_per_node}" for i in range(cluster.nodes))
    server = subprocess.Popen(cluster.exec_prefix(0) + [sys.executable, str(HERE / "cluster_rendezvous.py"), hosts],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = server.stdout.readline().strip()
    if not line.isdigit():
        stop_processes([server])
        raise RuntimeError(f"Horovod's rendezvous server did not start (printed {line!r})")
    return server, int(line)


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Kill each process's whole session (a worker and anything it started) and reap it."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()


def _progress(out: Path, workers: int) -> tuple[float, int]:
    """Latest progress time of any worker and the fewest steps any worker has finished."""
    files = [out / f"rank{rank}.progress" for rank in range(workers)]
    present = [f for f in files if f.exists()]
    latest = max((f.stat().st_mtime for f in present), default=0.0)
    steps = [int(f.read_text() or 0) for f in present]
    return latest, min(steps) if len(steps) == workers else 0


def _error_line(out: Path, workers: int, first: int) -> str:
    """The error message of a failed run, rank ``first``'s log searched before the others': its first line
    with a message (a C++ ``what()``, a Python ``...Error:``), else its last error-looking line (an
    abort), without torch's ``[rankN]:`` prefix; else the last line of that rank's log."""
    order = [first] + [rank for rank in range(workers) if rank != first]
    logs = [(out / f"rank{rank}.log").read_text(errors="replace").splitlines() for rank in order]
    for log in logs:
        messages = [line for line in log if MESSAGE_LINE.search(line)]
        errors = [line for line in log if ERROR_LINE.search(line)]
        if messages or errors:
            return RANK_PREFIX.sub("", (messages or errors[-1:])[0]).strip()[:300]
    return (logs[0] or ["(no output)"])[-1].strip()[:300]


def run_scheme(cluster: Cluster, args: argparse.Namespace, scheme: str, index: int) -> dict[str, Any]:
    """Run one scheme's workers in the cluster and return its record (ok, hang or error)."""
    base = {"scheme": scheme, "nodes": cluster.nodes, "workers_per_node": args.workers_per_node,
            "rate": cluster.rate, "rate_bps": cluster.rate_bps, "model": args.model, "reps": args.reps,
            "warmup": args.warmup, "threads": args.threads}
    workers = cluster.nodes * args.workers_per_node
    ddp = parse_scheme(scheme).torch_distributed
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="hvdcomp-cluster-") as tmp:
        out = Path(tmp)
        try:
            command = [sys.executable, str(HERE / "cluster_worker.py"), "--scheme", scheme, "--model", args.model,
                       "--warmup", str(args.warmup), "--reps", str(args.reps), "--threads", str(args.threads),
                       "--out", str(out)]
            if ddp:
                command += ["--ddp-init", f"tcp://{cluster.address(0)}:{DDP_PORT + index}"]
            else:
                server, rendezvous_port = start_rendezvous(cluster, args)
                processes.append(server)
            python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
            for node in range(cluster.nodes):
                for local in range(args.workers_per_node):
                    extra = (_ddp_env(cluster, args, node, local) if ddp
                             else horovod_env(cluster, args, node, local, rendezvous_port))
                    env = {**os.environ, **extra, "PYTHONPATH": python_path}
                    log = open(out / f"rank{node * args.workers_per_node + local}.log", "w")
                    processes.append(subprocess.Popen(cluster.exec_prefix(node) + command, env=env, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True))
                    log.close()
            return _watch(base, processes[-workers:], out, workers, args)
        finally:
            stop_processes(processes)
            if args.logs:
                kept = Path(args.logs) / cluster.rate / scheme.replace(":", "-")
                shutil.copytree(out, kept, dirs_exist_ok=True)


def _watch(base: dict[str, Any], workers: list[subprocess.Popen], out: Path, count: int,
           args: argparse.Namespace) -> dict[str, Any]:
    """Wait for the workers: every result written -> ok (a worker slow to exit afterwards does not matter);
    one exits non-zero -> error; no worker started within ``startup_timeout``, or no progress after
    start-up for ``stall_timeout`` -> hang."""
    started = time.time()
    while True:
        results = [out / f"rank{rank}.json" for rank in range(count)]
        if all(result.exists() for result in results):
            return cluster_report.summarize(base, [json.loads(result.read_text()) for result in results])
        codes = [w.poll() for w in workers]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(KILL_GRACE_S)  # let the others print their side of it
            stop_processes(workers)
            return cluster_report.failed(base, "error", f"rank {failed[0]} exited {codes[failed[0]]}: "
                                                        f"{_error_line(out, count, failed[0])}")
        latest, steps = _progress(out, count)
        if latest == 0.0 and time.time() - started > args.startup_timeout:
            return cluster_report.failed(base, "hang", f"no worker started within {args.startup_timeout:.0f} s")
        if latest and time.time() - latest > args.stall_timeout:
            return cluster_report.failed(base, "hang", f"no progress for {args.stall_timeout:.0f} s after {steps} "
                                                       f"of {base['warmup'] + base['reps']} steps")
        time.sleep(0.2)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that tear the cluster down


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = why_unavailable()
    if reason:
        print(f"cluster.py: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    for name in remove_stale():
        print(f"removed namespace {name} left by an earlier run", file=sys.stderr)
    records: list[dict[str, Any]] = []
    for rate, _ in args.rate_list:
        with Cluster(args.nodes, rate, args.delay) as cluster:
            print(f"\n{args.model}, {args.nodes} nodes x {args.workers_per_node} workers, {rate} links"
                  f"{f', {args.delay} delay' if args.delay else ''}, {args.threads} thread(s) per worker, "
                  f"median/min of {args.reps} steps after {args.warmup} warm-up", flush=True)
            these = []
            for index, scheme in enumerate(args.scheme_list):
                these.append(run_scheme(cluster, args, scheme, index))
                record = these[-1]
                shown = f"{record['median_s']:.3f} s" if record["status"] == "ok" else record["status"]
                print(f"  {scheme}: {shown}", file=sys.stderr, flush=True)
            print(cluster_report.table(these), flush=True)
            records += these
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        cluster_report.plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
