"""Plot runs' JSON-lines logs (from examples/train.py): loss and top-1 vs epoch and vs wall time, and bytes sent.

    python examples/plot.py runs/*.jsonl --out runs/comparison.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_run(path: Path) -> tuple[dict, list[dict]]:
    """(config, epoch records) of one log; ``ValueError`` if it has no config line or no epochs."""
    config, epochs = None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("type") == "config":
            config = record
        elif record.get("type") == "epoch":
            epochs.append(record)
    if config is None or not epochs:
        raise ValueError(f"{path} holds no config line or no epoch records")
    return config, epochs


DEFAULT_DOORS = ("hvdcomp.DistributedOptimizer", "hvdcomp.Birder")  # left out of the labels


def label(config: dict) -> str:
    scheme = config["scheme"]
    if scheme in ("qsgd", "randk", "qsgd-multiscale", "randk-multiscale"):
        scheme += " " + ",".join(map(str, config["bits"]))
    if scheme == "powersgd":
        scheme += f" r{config['rank']}"
    if config.get("min_compress_numel") is not None:
        scheme += f" min {config['min_compress_numel']}"
    door = config.get("door", DEFAULT_DOORS[0])
    return scheme + (" hier" if config.get("hierarchical") else "") + ("" if door in DEFAULT_DOORS else f" ({door})")


def machine(config: dict) -> str | None:
    """The machine a run's config records (CPU, usable cores, versions), or None for a log without one."""
    m = config.get("machine")
    if m is None:
        return None
    return (f"{m['cpu']}, {m['usable_cpus']} cores, torch {m['torch']}, Horovod {m['horovod']}, "
            f"hvdcomp {m['hvdcomp']}")


def plot(paths: list[Path], out: Path) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    machines = set()
    for path in paths:
        config, epochs = read_run(path)
        name = label(config)
        machines.add(machine(config))
        epoch = [r["epoch"] for r in epochs]
        wall = [r["wall_s"] for r in epochs]
        sent = [sum(r["inter_node_bytes"] for r in epochs[: i + 1]) / 2**20 for i in range(len(epochs))]
        for row, key in enumerate(("test_loss", "top1")):
            values = [r[key] for r in epochs]
            axes[row][0].plot(epoch, values, label=name)
            axes[row][1].plot(wall, values, label=name)
            axes[row][2].plot(sent, values, label=name)
            axes[row][0].set_ylabel("test loss" if key == "test_loss" else "top-1 (%)")
    for ax, xlabel in zip(axes[1], ("epoch", "wall time (s)", "MiB sent between nodes per worker")):
        ax.set_xlabel(xlabel)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("; ".join(sorted(m or "machine not recorded" for m in machines)), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("runs/comparison.png"))
    args = parser.parse_args()
    plot(args.logs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
