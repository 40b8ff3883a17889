"""GPU timing of one GRPO trainer step: the logits path against fused-linear at a realistic
model size, then grpo_fast's step against TRL's.

Loss paths: a randomly initialised Llama (hidden 1024, 12 layers, vocabulary 32000, about
0.2B parameters; the demo's tokenizer padded to that vocabulary) trains on the arithmetic
prompts: 64 completions per step (G = 8), 128 new tokens (a random model rarely stops
early), beta = 0.04 (frozen reference copy), bf16 autocast. For each loss path, one warm-up
step, then ``--steps`` timed steps; the JSON has the median step time, its split into
rollout (generation, rewards, reference log-probs) and update, tokens/s, and the peak of
``torch.cuda.max_memory_allocated`` over the step.

Against TRL (``engines`` in the JSON): ``benchmarks/bench_trainer.py``'s realistic workload
(Llama hidden 256, 4 layers, vocabulary 32000, 32 completions of up to 128 tokens) on CUDA,
one round of ``--engine-steps`` steps (the first dropped) per engine, each in a fresh
process, with its phase split and peak memory: with vLLM when the image has it (ours
``--generator vllm`` against TRL 1.16's colocated engine), else ours with its sampler
against TRL with Hugging Face ``generate``. A row whose packages are missing (TRL and its
dependencies travel as wheels, ``benchmarks/gpu/README.md``) is listed under ``skipped`` with
why. It runs in what ``--budget-s`` leaves after the loss paths; a row that would not fit
says so.

    python benchmarks/gpu/bench_trainer_step.py             # CUDA, about 2 minutes on an H200
    python benchmarks/gpu/bench_trainer_step.py --dry-run   # CPU, the demo-sized models, seconds
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from trainer_bench import TRL_ENGINES  # noqa: E402
from trainer_bench.compare import compare, runnable  # noqa: E402
from trainer_bench.report import print_results  # noqa: E402
from trainer_bench.workloads import realistic_workload, tiny_workload  # noqa: E402

from grpo_fast.bench.measure import machine_info  # noqa: E402
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer  # noqa: E402
from grpo_fast.trainer import GRPOConfig, GRPOTrainer  # noqa: E402

GPU_MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
)
DRY_MODEL = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64
)
GPU_RUN = dict(batch_size=64, group_size=8, max_new_tokens=128, beta=0.04)
DRY_RUN = dict(batch_size=8, group_size=4, max_new_tokens=8, beta=0.04)


def time_variant(fused_linear: bool, model_sizes: dict, run: dict, steps: int, device: str) -> dict:
    """Median step / rollout / update seconds, tokens/s and peak memory of one loss path."""
    sizes = dict(model_sizes)
    tokenizer = build_tokenizer(sizes.pop("vocab_size"))
    model = build_model(tokenizer, seed=0, **sizes)
    config = GRPOConfig(
        **run,
        steps=steps + 1,
        fused_linear=fused_linear,
        device=device,
        warmup_steps=0,
        output_dir=tempfile.mkdtemp(prefix="bench-trainer-step-"),
        progress=False,
    )
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    rollout_times = []

    def timed(stage):  # the rollout: the source's samples, then the step's batch (the reference pass)
        def run(*args):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = stage(*args)
            if device == "cuda":
                torch.cuda.synchronize()
            rollout_times[-1] += time.perf_counter() - start
            return out

        return run

    trainer.source.next, trainer.prepare = timed(trainer.source.next), timed(trainer.prepare)
    history = []
    for _ in range(steps + 1):
        rollout_times.append(0.0)
        history.append(trainer.train_step())
    history = history[1:]  # the first step warms up
    step_s = statistics.median(m["step_time_s"] for m in history)
    rollout_s = statistics.median(rollout_times[1:])
    return {
        "loss_path": "fused_linear_grpo_loss" if fused_linear else "grpo_loss on completion logits",
        "step_s": step_s,
        "rollout_s": rollout_s,
        "update_s": step_s - rollout_s,
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in history),
        "completion_len_mean": statistics.mean(m["completion_len_mean"] for m in history),
        "peak_mem_bytes": max(m["peak_mem_bytes"] for m in history),
        "steps": steps,
    }


def against_trl(dry_run: bool, device: str, steps: int, deadline: float) -> dict:
    """grpo_fast's step against TRL's (module docstring) on bench_trainer.py's realistic workload
    (its tiny one on a dry run), rows started before ``deadline`` (``time.monotonic()``)."""
    with_vllm = importlib.util.find_spec("vllm") is not None
    engines, skipped = runnable(["vllm", "trl_vllm"] if with_vllm else ["sampler", "trl"])
    for engine in set(skipped) & set(TRL_ENGINES):
        skipped[engine] += ": carry its wheels (benchmarks/gpu/README.md)"
    if not with_vllm:
        why = "vllm not installed (its CUDA wheel is over the carry limit): the sampler and HF generate rows stand in"
        skipped.update(vllm=why, trl_vllm=why)
    for engine, why in skipped.items():
        print(f"trainer vs TRL: skipping {engine}: {why}", flush=True)
    work = (tiny_workload if dry_run else realistic_workload)(argparse.Namespace(seed=0))
    # one thread on the dry run's CPU, as bench_trainer.py; on CUDA torch's default for the host side
    threads = 1 if dry_run else torch.get_num_threads()
    options = dict(steps=steps, threads=threads, seed=0, device=device, trl_as_shipped=False)
    results, versions = compare(work, engines, options, rounds=1, warmup=1, deadline=deadline)
    print_results(results)
    return dict(
        workload=work.name,
        model=work.description,
        engines=engines,
        skipped=skipped,
        warmup=1,
        **options,
        results=results,
        versions=versions,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the demo-sized models, 2 steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per loss path (dry run: 1)")
    parser.add_argument(
        "--engine-steps", type=int, default=4, help="steps per engine against TRL, the first dropped (dry run: 2)"
    )
    parser.add_argument("--budget-s", type=float, default=600, help="no engine row starts or runs past this")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/trainer_step_gpu.json)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    out_dir = os.environ.get("OUT", "benchmarks/results")
    out = args.out or os.path.join(out_dir, "trainer_step_dryrun.json" if args.dry_run else "trainer_step_gpu.json")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU check of the code path")
    device = "cpu" if args.dry_run else "cuda"
    model_sizes, run = (DRY_MODEL, DRY_RUN) if args.dry_run else (GPU_MODEL, GPU_RUN)
    steps = 1 if args.dry_run else args.steps

    report = {
        "benchmark": "GRPO trainer step (rollout with HF generate + update), bf16 autocast on CUDA; then against TRL",
        "dry_run": args.dry_run,
        "model": model_sizes,
        "run": run,
        "machine": machine_info(),
        "results": [],
    }
    for fused_linear in (False, True):
        row = time_variant(fused_linear, model_sizes, run, steps, device)
        report["results"].append(row)
        print(json.dumps(row), flush=True)
    write(report, out)  # the loss paths now: a run cut while against TRL keeps them
    report["engines"] = against_trl(args.dry_run, device, 2 if args.dry_run else args.engine_steps, deadline)
    write(report, out)


def write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
