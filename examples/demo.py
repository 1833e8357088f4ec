"""``make demo``: offline distributed training on scikit-learn's handwritten digits, uncompressed vs compressed.

Launches ``examples/train.py`` under ``horovodrun --gloo`` for each scheme, then prints each run's
final top-1 accuracy and the bytes each worker sent, and plots the runs to ``runs/demo/comparison.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {
    "fp32 all-reduce": ["--scheme", "none"],
    "QSGDMaxNorm(4)": ["--scheme", "qsgd", "--bits", "4"],
    "Birder (1 bit)": ["--scheme", "birder", "--birder-lr", "0.01", "--birder-weight-decay", "0.0"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--log-dir", type=Path, default=Path("runs/demo"))
    args = parser.parse_args()
    horovodrun = Path(sys.executable).parent / "horovodrun"
    logs = []
    for name, flags in RUNS.items():
        run_name = flags[1] + "".join(flags[3:4])
        print(f"== {name}: {args.workers} workers, {args.epochs} epochs", flush=True)
        command = [str(horovodrun), "--gloo", "-np", str(args.workers), sys.executable, str(HERE / "train.py"),
                   "--epochs", str(args.epochs), "--batch-size", "32", "--log-dir", str(args.log_dir),
                   "--run-name", run_name, "--no-progress", *flags]
        subprocess.run(command, check=True)
        logs.append((name, args.log_dir / f"{run_name}.jsonl"))
    print("\n| scheme | final top-1 | bytes sent per worker | compression |")
    print("|---|---|---|---|")
    for name, path in logs:
        epochs = [json.loads(line) for line in path.read_text().splitlines()[1:]]
        sent = sum(r["inter_node_bytes"] for r in epochs)
        full = sum(r["uncompressed_bytes"] for r in epochs)
        print(f"| {name} | {epochs[-1]['top1']:.2f}% | {sent / 2**20:.2f} MiB | x{full / sent:.1f} |")
    subprocess.run([sys.executable, str(HERE / "plot.py"), *(str(p) for _, p in logs), "--out",
                    str(args.log_dir / "comparison.png")], check=True)


if __name__ == "__main__":
    main()
