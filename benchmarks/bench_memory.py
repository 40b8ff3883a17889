"""PPO against GRPO: peak memory and step time of a training step (see grpo_fast/bench/memory.py).

The same as ``grpo-fast bench memory``, with the results written next to the other
benchmarks' unless --json / --plot say otherwise:

    python benchmarks/bench_memory.py                  # preset 100m -> results/memory_cpu_100m.{json,png}
    python benchmarks/bench_memory.py --preset 1b      # on a GPU    -> results/memory_cuda_1b.{json,png}
"""

import argparse
import os
import sys

from grpo_fast.bench import memory

if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--preset", "100m"), ("--device", "auto"), ("--json", None), ("--plot", None)):
        parser.add_argument(flag, default=default)
    args, _ = parser.parse_known_args()

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    stem = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"memory_{device}_{args.preset}")
    argv = sys.argv[1:] + ([] if args.json else ["--json", stem + ".json"])
    argv += [] if args.plot else ["--plot", stem + ".png"]
    sys.exit(memory.main(argv))
