"""Results of ``benchmarks/cluster.py``: one record per (scheme, rate), the Markdown table and the plot.

Pure apart from ``plot`` (matplotlib, imported there): the records are built from the workers'
``rank<R>.json`` files (see ``cluster_worker``) and are what ``--json`` writes.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from cluster_schemes import SIXTEEN_BIT_PEERS

FP32_BASELINE = "horovod:fp32"
FLOOR = "local:sgd"  # no exchange: the fastest a step can be (cluster_schemes)
DETAIL_CHARS = 100  # of a hang's or error's detail in the table (the JSON keeps it whole)
FAMILY_LINES = {"hvdcomp": "-", "horovod": "--", "ddp": ":", "stock": "-.", "hvdcomp-ddp": (0, (5, 1, 1, 1, 1, 1)),
                "local": (0, (1, 4))}
SECONDS = ("compress_s", "communicate_s", "decompress_s")
CPU_SECONDS = ("main_cpu_s", "process_cpu_s")


def summarize(base: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``ok`` record from every rank's worker result. ``base`` holds the run's identity (scheme, nodes,
    workers_per_node, rate, model, ...). A step lasts until its slowest worker is done, so each timed
    step counts the max over ranks; ``median_s``/``min_s`` are over the timed steps. Bits per element
    between nodes: what each worker handed to cross-node collectives (hvdcomp's ``inter_node_bytes``
    per parameter), else the peer's payload width; the codec seconds and the CPU seconds (``main_cpu_s``, of the
    thread that steps; ``process_cpu_s``, of all the worker's threads) are means over ranks, medians over steps."""
    step_s = [max(steps) for steps in zip(*(rank["step_s"] for rank in ranks))]
    record = {**base, "status": "ok", "detail": "", "elements": ranks[0]["elements"], "step_s": step_s,
              "median_s": statistics.median(step_s), "min_s": min(step_s),
              **{name: _median_of_means(rank[name] for rank in ranks) for name in CPU_SECONDS},
              "bits_per_element": ranks[0]["payload_bits"], **{name: None for name in SECONDS},
              "codec_ns_per_element": None}
    traffic = [rank["traffic"] for rank in ranks]
    if all(step is not None for steps in traffic for step in steps):

        def median_of_means(key: str) -> float:
            return _median_of_means([step[key] for step in steps] for steps in traffic)

        record["bits_per_element"] = 8 * median_of_means("inter_node_bytes") / record["elements"]
        record.update({name: median_of_means(name) for name in SECONDS})
        record["codec_ns_per_element"] = codec_ns_per_element(record)
    return record


def _median_of_means(per_rank: Iterable[Sequence[float]]) -> float:
    """The median over the steps of the mean over the ranks; ``per_rank``: each rank's value of each step."""
    return statistics.median(map(statistics.fmean, zip(*per_rank)))


def codec_ns_per_element(record: dict[str, Any]) -> float | None:
    """The codec's cost in situ: (compress + decompress seconds) per element, in ns (None without statistics),
    to set beside ``benchmarks/codec_costs.py``'s kernel times."""
    if record["compress_s"] is None or not record["elements"]:
        return None
    return 1e9 * (record["compress_s"] + record["decompress_s"]) / record["elements"]


def failed(base: dict[str, Any], status: str, detail: str) -> dict[str, Any]:
    """A record for a scheme that hung (``status="hang"``) or failed (``"error"``); no timings."""
    return {**base, "status": status, "detail": detail, "median_s": None, "min_s": None, "step_s": [],
            **{name: None for name in CPU_SECONDS}, "bits_per_element": None, **{name: None for name in SECONDS},
            "codec_ns_per_element": None}


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def best_16_bit_peer(medians: dict[str, float]) -> str | None:
    """The fastest of the 16-bit all-reduce peers (``SIXTEEN_BIT_PEERS``) with a median in ``medians``, or None."""
    return min((peer for peer in SIXTEEN_BIT_PEERS if peer in medians), key=medians.__getitem__, default=None)


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table of the records of one cluster shape and rate, in their order; speed-ups are a
    baseline's median over the scheme's median (``×1.5``: 1.5 times as fast): ``horovod:fp32``'s, the best
    16-bit peer's (the fastest of ``horovod:fp16``, ``ddp:fp16`` and ``ddp:bf16`` among these records, named in
    the header), and the floor's (``local:sgd``, no exchange: ``×0.80`` is 80 % of the speed of a step without
    one); a hang or error shows its status and the start of its detail."""
    medians = {r["scheme"]: r["median_s"] for r in records if r["status"] == "ok"}
    peer = best_16_bit_peer(medians)
    baselines = (FP32_BASELINE, peer, FLOOR)
    lines = ["| scheme | bits/element between nodes | median s | min s | CPU s: main thread / all | compress s "
             f"| communicate s | decompress s | codec ns/element | vs {FP32_BASELINE} "
             f"| vs best 16-bit peer ({peer or 'none ran'}) | vs {FLOOR} (no exchange) |",
             "|---" * (9 + len(baselines)) + "|"]
    for r in records:
        if r["status"] != "ok":
            detail = r["detail"] if len(r["detail"]) <= DETAIL_CHARS else r["detail"][:DETAIL_CHARS] + "…"
            lines.append(f"| {r['scheme']} | – | {r['status']}: {detail} |" + " – |" * (6 + len(baselines)))
            continue
        speedups = [f"×{medians[b] / r['median_s']:.2f}" if b in medians else "–" for b in baselines]
        cells = [r["scheme"], _number(r["bits_per_element"], 2), _number(r["median_s"], 3), _number(r["min_s"], 3),
                 " / ".join(_number(r[name], 3) for name in CPU_SECONDS), *(_number(r[name], 3) for name in SECONDS),
                 _number(r["codec_ns_per_element"], 2), *speedups]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    """PNG of median seconds per exchange against link rate (log axes), one line per scheme, line style by
    family (hvdcomp solid, Horovod dashed, DDP dotted, stock dash-dot, hvdcomp-ddp dash-dot-dot, the floor sparsely
    dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab20").colors
    for index, scheme in enumerate(dict.fromkeys(r["scheme"] for r in records)):
        points = sorted((r["rate_bps"], r["median_s"]) for r in records
                        if r["scheme"] == scheme and r["status"] == "ok")
        if points:
            axes.plot(*zip(*points), marker="o", label=scheme, color=colors[index % len(colors)],
                      linestyle=FAMILY_LINES.get(scheme.split(":")[0], "-"))
    first = next((r for r in records if r["status"] == "ok"), records[0])
    size = f" ({first['elements'] / 1e6:.2f}M parameters)" if first.get("elements") else ""
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("link rate (bit/s)")
    axes.set_ylabel("seconds per exchange (median)")
    axes.set_title(f"{first['model']}{size}, {first['nodes']} nodes × {first['workers_per_node']} worker(s)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
