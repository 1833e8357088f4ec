"""Seconds per Horovod collective between emulated nodes: why ``HorovodTransport`` sends large all-to-alls and
all-gathers of one shape as all-to-alls of pieces.

Builds ``cluster.py``'s network (``--nodes`` namespaces behind one switch, links shaped to ``--rate``), starts one
Horovod Gloo worker per node, and times each collective below on ``--elements`` values (ResNet-50's gradient by
default), side by side in one run: the median and min of ``--reps`` calls after one untimed call. "MB sent" is
what each worker sends (its link's load, each way; a ring all-reduce sends ``2 (W - 1) / W`` of its tensor);
"Gbit/s" is that over the median. Needs root.

    python benchmarks/cluster_collectives.py --nodes 2 --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from cluster import REPO_ROOT, horovod_env, start_rendezvous, stop_processes
from cluster_netns import Cluster, why_unavailable


def _collectives(elements: int) -> list[tuple[str, float, Callable[[], Any]]]:
    """(name, bytes each worker sends, call) per collective; in a Horovod worker."""
    import horovod.torch as hvd
    import torch

    from hvdcomp.exchange.protocol import Op
    from hvdcomp.transport.horovod import HorovodTransport

    workers, transport = hvd.size(), HorovodTransport()
    floats, halves = torch.randn(elements), torch.randn(elements).half()
    chunk = halves[: elements // workers]
    ring, spread = 2 * (workers - 1) / workers, (workers - 1) / workers  # bytes sent per byte of the tensor
    return [
        ("Horovod all-reduce, float32", 4 * elements * ring, lambda: hvd.allreduce(floats, op=hvd.Sum, name="f32")),
        ("Horovod all-reduce, float16", 2 * elements * ring, lambda: hvd.allreduce(halves, op=hvd.Sum, name="f16")),
        ("HorovodTransport Op.SUM, float16 (all-to-all pieces)", 2 * elements * ring,
         lambda: transport.collective(Op.SUM, halves)),
        ("Horovod all-to-all, float16, one call", 2 * elements * spread, lambda: hvd.alltoall(halves, name="a2a")),
        ("HorovodTransport Op.ALLTOALL (pieces)", 2 * elements * spread,
         lambda: transport.collective(Op.ALLTOALL, halves)),
        ("Horovod all-gather, float16, one call", 2 * chunk.numel() * (workers - 1),
         lambda: hvd.allgather(chunk, name="ag")),
        ("HorovodTransport Op.ALLGATHER_EQUAL (pieces)", 2 * chunk.numel() * (workers - 1),
         lambda: transport.collective(Op.ALLGATHER_EQUAL, chunk)),
    ]


def worker(elements: int, reps: int, piece_kib: int, out: Path) -> None:
    """Time every collective in this Horovod worker; rank 0 writes the rows to ``out`` (JSON)."""
    import horovod.torch as hvd
    import torch

    from hvdcomp.transport import horovod

    horovod.ALLTOALL_PIECE_BYTES = piece_kib * 1024
    hvd.init()
    torch.set_num_threads(1)
    rows = []
    for name, sent_bytes, call in _collectives(elements):
        call()
        seconds = []
        for _ in range(reps):
            hvd.barrier()
            started = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - started)
        rows.append({"collective": name, "sent_mb": sent_bytes / 1e6, "median_s": statistics.median(seconds),
                     "min_s": min(seconds)})
    if hvd.rank() == 0:
        out.write_text(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="link rate in tc units (default 1gbit)")
    parser.add_argument("--elements", type=int, default=23_520_842, help="values per worker (ResNet-50's)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--piece-kib", type=int, default=512, help="HorovodTransport's piece size (default 512)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # inside a node: write the rows here
    args = parser.parse_args()
    if args.worker:
        worker(args.elements, args.reps, args.piece_kib, args.worker)
        return 0
    reason = why_unavailable()
    if reason:
        print(f"cluster_collectives.py: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hvdcomp-collectives-") as tmp, Cluster(args.nodes, args.rate) as cluster:
        out = Path(tmp) / "rows.json"
        layout = argparse.Namespace(workers_per_node=1)
        server, port = start_rendezvous(cluster, layout)
        command = [sys.executable, __file__, "--worker", str(out), "--elements", str(args.elements),
                   "--reps", str(args.reps), "--piece-kib", str(args.piece_kib)]
        workers = [subprocess.Popen(cluster.exec_prefix(node) + command,
                                    env={**os.environ, **horovod_env(cluster, layout, node, 0, port),
                                         "PYTHONPATH": str(REPO_ROOT)})
                   for node in range(args.nodes)]
        try:
            failed = [w.wait() for w in workers]
        finally:
            stop_processes([server, *workers])
        if any(failed) or not out.exists():
            print(f"cluster_collectives.py: a worker failed (exit codes {failed})", file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    print(f"{args.nodes} nodes x 1 worker, {args.rate} links, {args.elements} values, pieces of {args.piece_kib} KiB, "
          f"median/min of {args.reps}")
    print("| collective | MB sent | median s | min s | Gbit/s |\n|---|---|---|---|---|")
    for row in rows:
        rate = row["sent_mb"] * 8e-3 / row["median_s"]
        print(f"| {row['collective']} | {row['sent_mb']:.1f} | {row['median_s']:.3f} | {row['min_s']:.3f} "
              f"| {rate:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
