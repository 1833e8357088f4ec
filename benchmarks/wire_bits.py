"""Print the wire bits per element of the packed QSGD max-norm payload for a grid of bits x workers, and the
real bytes of the lanes and of the two-stage exchange up to W = 4096.

``int64 Sum`` is the packed path of both our optimizer and the stock-optimizer compressors (63 usable
bits per word); ``float64 carrier`` is for packed words carried through a float reduction
(``carrier.word_bits(W)`` usable bits per word). The seed's code sends
8 bits (b < 8, overflowing once W * s > 127) or 32 bits (b = 8) per element.

``--exchanges`` builds one worker's real messages for a bucket of ``--numel`` elements with the packing code
(``LaneLayout.pack``; ``two_stage.stage_one_message`` / ``stage_two_message``) and prints what each worker sends
under ring collectives (``cost.ring_wire_bytes``): lanes by all-reduce; two-stage by all-to-all then all-gather.
"""

import argparse

import torch

from hvdcomp.codec import carrier
from hvdcomp.codec.packing import INT64_WORD_BITS, LaneLayout
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange.cost import ring_wire_bytes
from hvdcomp.exchange.hierarchy import shard_length
from hvdcomp.exchange.protocol import Reduction
from hvdcomp.exchange.two_stage import stage_one_message, stage_two_message


def lanes_table(bits_list: list[int], workers: list[int]) -> None:
    for title, word_bits_for in (("int64 Sum", lambda w: INT64_WORD_BITS), ("float64 carrier", carrier.word_bits)):
        print(f"\nbits/element on the wire, {title} (usable bits per 64-bit word: "
              + ", ".join(f"W={w}: {word_bits_for(w)}" for w in workers) + ")")
        print("| bits \\ W | " + " | ".join(str(w) for w in workers) + " |")
        print("|---" * (len(workers) + 1) + "|")
        for bits in bits_list:
            cells = []
            for world_size in workers:
                layout = LaneLayout.for_levels(2**bits - 1, world_size, word_bits_for(world_size))
                cells.append(f"{layout.bits_per_element:.2f} (lane {layout.lane_width})")
            print(f"| {bits} | " + " | ".join(cells) + " |")


def exchange_wire_bytes(bits: int, world_size: int, numel: int) -> tuple[float, float]:
    """(lanes, two-stage) bytes one worker sends under ring collectives, from its real messages."""
    quantizer = MaxNormQuantizer((bits,))
    s = quantizer.coarse_levels
    levels = torch.randint(-s, s + 1, (numel,), generator=torch.Generator().manual_seed(bits))
    lanes = quantizer.payload_layout(world_size).pack(levels, validate=False)
    lanes_bytes = ring_wire_bytes(Reduction.SUM, lanes.numel() * lanes.element_size(), world_size)
    first = stage_one_message(levels, quantizer, world_size)
    chunk = levels[: shard_length(numel, world_size)]
    second = stage_two_message(chunk, torch.ones(1), quantizer)
    two_stage = (ring_wire_bytes(Reduction.ALLTOALL, first.numel(), world_size)
                 + ring_wire_bytes(Reduction.ALLGATHER, second.numel(), world_size))
    return lanes_bytes, two_stage


def exchanges_table(bits_list: list[int], workers: list[int], numel: int) -> None:
    print(f"\nbits/element each worker sends (ring collectives), {numel} elements: lanes / two-stage (real messages)")
    print("| bits \\ W | " + " | ".join(str(w) for w in workers) + " |")
    print("|---" * (len(workers) + 1) + "|")
    for bits in bits_list:
        cells = []
        for world_size in workers:
            lanes, two_stage = exchange_wire_bytes(bits, world_size, numel)
            cells.append(f"{8 * lanes / numel:.2f} / {8 * two_stage / numel:.2f}")
        print(f"| {bits} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--exchanges", action="store_true", help="also compare lanes and two-stage, real bytes")
    parser.add_argument("--exchange-workers", type=int, nargs="+", default=[2, 8, 32, 128, 512, 1024, 4096])
    parser.add_argument("--numel", type=int, default=2**20, help="bucket size for --exchanges")
    args = parser.parse_args()
    lanes_table(args.bits, args.workers)
    if args.exchanges:
        exchanges_table(args.bits, args.exchange_workers, args.numel)


if __name__ == "__main__":
    main()
