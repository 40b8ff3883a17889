"""Host reads of one steady-state training update: how often the host waits for the device.

Counts, with ``grpo_fast.bench.measure.HostReads`` (a dispatch mode), the device-to-host
reads of one ``GRPOTrainer.train_step`` after a warm-up step, the rollout held fixed (its
sampler reads once per decode step, by design): the demo model, num_iterations = 2 (two
optimizer steps), micro-batches of 5 rows, beta = 0.1. The counter is loaded from this
checkout by path, so that an older checkout's trainer can be measured with the same one:

    python benchmarks/count_host_reads.py [--fused-linear]
    PYTHONPATH=<older checkout> python benchmarks/count_host_reads.py    # before/after
"""

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile

from grpo_fast.trainer import GRPOConfig, GRPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def load_counter():
    path = os.path.join(HERE, "..", "grpo_fast", "bench", "measure.py")
    spec = importlib.util.spec_from_file_location("measure_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostReads


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused-linear", action="store_true")
    args = parser.parse_args()
    HostReads = load_counter()

    class Sites(HostReads):  # also where each read happens: the innermost grpo_fast frame
        def __init__(self):
            super().__init__()
            self.sites = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.count
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.count > before:
                frame = sys._getframe(1)
                while frame is not None and "grpo_fast" not in frame.f_code.co_filename:
                    frame = frame.f_back
                site = "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                self.sites[site] += 1
            return out

    config = GRPOConfig(
        batch_size=16,
        group_size=4,
        max_new_tokens=6,
        beta=0.1,
        num_iterations=2,
        micro_batch_size=5,
        fused_linear=args.fused_linear,
        progress=False,
        output_dir=tempfile.mkdtemp(prefix="host-reads-"),
    )
    trainer = GRPOTrainer(config)
    samples = trainer.source.next(trainer.data_position, trainer.version)
    batch = trainer.prepare(samples)  # one batch, its reference log-probs and packing included, every step
    trainer.source.next, trainer.prepare = (lambda position, version: samples), (lambda samples: batch)
    trainer.train_step()
    with Sites() as reads:
        trainer.train_step()
    sites = dict(reads.sites)
    sites["(tolist)"] = reads.calls.count("tolist")
    print(json.dumps(dict(fused_linear=args.fused_linear, host_reads=reads.count, optimizer_steps=2, sites=sites)))


if __name__ == "__main__":
    main()
