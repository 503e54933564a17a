"""Reading a GGUF file's metadata and tensor table: Tandem's container reader against the
gguf package's GGUFReader, on the same file, in one run.

    python bench/gguf_read.py [--rounds 5] [--path FILE]

Baseline: gguf.GGUFReader (with its fields' contents read, as a loader needs them),
the reader the engine used before. Default file: SmolLM2-135M-Instruct's Q4_1 GGUF
(49,152 vocabulary strings and 48,900 merges, where the time goes). Figures are
recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import gguf
from counts import count  # bench/ is on sys.path when run as a script

from tandem.engine.model.gguf_container import GGUFContainer
from tandem.engine.model.loader import smollm2_path


def theirs(path: Path) -> int:
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    return len(fields) + len(reader.tensors)


def ours(path: Path) -> int:
    container = GGUFContainer.read(path)
    return len(container.fields) + len(container.tensors)


def seconds(read, path: Path) -> float:
    start = time.perf_counter()
    read(path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=count, default=5, help="median of, each reader")
    parser.add_argument("--path", type=Path, default=None, help="default: SmolLM2's GGUF")
    args = parser.parse_args()
    path = args.path or smollm2_path()
    ours(path), theirs(path)  # warm: the file in the page cache, the imports done
    times: dict[str, list[float]] = {"tandem": [], "gguf": []}
    for _ in range(args.rounds):  # interleaved: a busy moment slows both alike
        times["tandem"].append(seconds(ours, path))
        times["gguf"].append(seconds(theirs, path))
    mine, base = statistics.median(times["tandem"]), statistics.median(times["gguf"])
    print(f"{path.name}: median of {args.rounds} reads each")
    print(f"{'reader':<24} {'ms':>10}")
    print(f"{'tandem GGUFContainer':<24} {mine * 1000:>10.3f}")
    print(f"{'gguf GGUFReader':<24} {base * 1000:>10.3f}")
    print(f"ratio {base / mine:.1f}x (GGUFReader's time over ours)")


if __name__ == "__main__":
    main()
