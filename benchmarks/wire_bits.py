"""Print the wire bits per element of the packed QSGD max-norm payload for a grid of bits x workers.

``int64 Sum`` is the packed path of both our optimizer and the stock-optimizer compressors (63 usable
bits per word); ``float64 carrier`` is for packed words carried through a float reduction
(``carrier.word_bits(W)`` usable bits per word). The seed's code sends
8 bits (b < 8, overflowing once W * s > 127) or 32 bits (b = 8) per element.
"""

import argparse

from hvdcomp.codec import carrier
from hvdcomp.codec.packing import INT64_WORD_BITS, LaneLayout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 128])
    args = parser.parse_args()
    for title, word_bits_for in (("int64 Sum", lambda w: INT64_WORD_BITS), ("float64 carrier", carrier.word_bits)):
        print(f"\nbits/element on the wire, {title} (usable bits per 64-bit word: "
              + ", ".join(f"W={w}: {word_bits_for(w)}" for w in args.workers) + ")")
        print("| bits \\ W | " + " | ".join(str(w) for w in args.workers) + " |")
        print("|---" * (len(args.workers) + 1) + "|")
        for bits in args.bits:
            cells = []
            for world_size in args.workers:
                layout = LaneLayout.for_levels(2**bits - 1, world_size, word_bits_for(world_size))
                cells.append(f"{layout.bits_per_element:.2f} (lane {layout.lane_width})")
            print(f"| {bits} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
