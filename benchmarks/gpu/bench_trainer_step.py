"""GPU timing of one GRPO trainer step: the logits path against fused-linear at a realistic
model size, then grpo_fast's step against TRL's.

Then (``shared_prefix`` in the JSON) one packed forward and backward with each group's
prompt once against every row whole, each on SDPA (at the device's cost of a call, and
split a call per length as on CPU) and on FlexAttention, checked against
whole rows on SDPA in float32 first (log-probs and gradients).

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
import contextlib
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
    history = [trainer.train_step() for _ in range(steps + 1)][1:]  # the first step warms up
    step_s = statistics.median(m["step_time_s"] for m in history)
    # the rollout: the samples, then the step's batch (the reference pass), by the trainer's clock
    rollout_s = statistics.median(m["time/rollout_s"] + m["time/prepare_s"] for m in history)
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


def shared_prefix_passes(model_sizes: dict, dry_run: bool, device: str, repeats: int) -> dict:
    """One micro-batch's packed forward and backward (the training pass's shape) with every row
    whole against each group's prompt once (``group_size=G``), each attended by SDPA on
    gathered grids of like length (at the device's cost of a call, and at CPU's: a call per
    length, ``sdpa_split``) and by FlexAttention with a block mask (``attention="flex"``), on the
    realistic workload's layout: 4 groups of G = 8, prompts of 100-120 tokens, completions of
    1-45. The check, in float32: each layout's log-probs, and on CUDA its gradient, against
    whole rows on SDPA (max abs difference; FlexAttention has no CPU backward, so the dry run
    times its forward only). Then bf16 autocast on CUDA: the median of ``repeats`` timed passes
    after a warm-up (FlexAttention's compilation falls in the warm-up), forward tokens, peak
    memory."""
    from grpo_fast import token_logprobs
    from grpo_fast.packing import pack_micro_batches, packed_logits, use_packed_attention
    from grpo_fast.packing.cost import HOST_COSTS, LayerShape, PackCost

    sizes = dict(model_sizes)
    torch.manual_seed(0)
    model = use_packed_attention(build_model(build_tokenizer(sizes.pop("vocab_size")), seed=0, **sizes).to(device))
    groups, G, (low, high), C = (2, 4, (6, 10), 6) if dry_run else (4, 8, (100, 120), 45)
    g = torch.Generator().manual_seed(0)
    P, V = high, model.config.vocab_size
    ids, mask = torch.zeros(groups * G, P + C, dtype=torch.long), torch.zeros(groups * G, P + C, dtype=torch.long)
    for k in range(groups):
        length = int(torch.randint(low, high + 1, (), generator=g))
        prompt = torch.randint(3, V, (length,), generator=g)
        for i in range(k * G, k * G + G):
            n = C if i % G == 0 else int(torch.randint(1, C + 1, (), generator=g))
            ids[i, P - length : P], ids[i, P : P + n] = prompt, torch.randint(3, V, (n,), generator=g)
            mask[i, P - length : P + n] = 1
    ids, mask = ids.to(device), mask.to(device)
    trains = device == "cuda"  # FlexAttention's backward is CUDA's only

    def pack_with(kernel: str, group_size):
        # sdpa_split: SDPA split by CPU's costs (packing.cost), about a call per length where
        # CUDA's costs make one per kind: whether splitting pays on a GPU
        cost = PackCost.of(model, device)
        if kernel == "sdpa_split":
            cost = PackCost(HOST_COSTS["cpu"], LayerShape.of(model.config))
        attention = "flex" if kernel == "flex" else "sdpa"
        return pack_micro_batches(ids, mask, C, None, None, group_size, attention=attention, cost=cost)[0]

    layouts = {
        (layout, kernel): pack_with(kernel, size)
        for kernel in ("sdpa", "sdpa_split", "flex")
        for layout, size in (("whole", None), ("shared", G))
    }

    def logprobs(packed, grad: bool):
        with torch.set_grad_enabled(grad):
            return token_logprobs(packed_logits(model, packed), packed.targets)

    def values(packed):  # float32 log-probs, and on CUDA the gradient of their sum
        model.zero_grad(set_to_none=True)
        logp = logprobs(packed, trains)
        if not trains:
            return logp, None
        logp.sum().backward()
        return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    truth = values(layouts["whole", "sdpa"])
    rows = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    for (layout, kernel), packed in layouts.items():
        logp, grad = values(packed)
        check = dict(max_abs_logprob_diff_fp32=(logp - truth[0]).abs().max().item())
        if grad is not None:
            check["grad_rel_err_fp32"] = ((grad - truth[1]).norm() / truth[1].norm()).item()
        times = []
        for _ in range(repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with autocast:
                loss = logprobs(packed, trains).sum()
            if trains:
                loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        rows.append(
            dict(
                layout=layout,
                attention=kernel,
                forward_tokens=packed.input_ids.shape[1],
                **check,
                passed=check["max_abs_logprob_diff_fp32"] < 1e-4 and check.get("grad_rel_err_fp32", 0.0) < 1e-4,
                fwd_bwd_s=statistics.median(times[1:]) if trains else None,
                fwd_s=None if trains else statistics.median(times[1:]),
                peak_mem_bytes=peak,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    key = "fwd_bwd_s" if trains else "fwd_s"
    base = rows[0][key]
    return dict(
        groups=groups,
        group_size=G,
        timed=key,
        check_passed=all(row["passed"] for row in rows),
        speedup={f"{row['layout']}/{row['attention']}": base / row[key] for row in rows},
        rows=rows,
    )


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
    report["shared_prefix"] = shared_prefix_passes(model_sizes, args.dry_run, device, 1 if args.dry_run else 5)
    write(report, out)  # the loss paths and the shared prefix now: a run cut while against TRL keeps them
    report["engines"] = against_trl(args.dry_run, device, 2 if args.dry_run else args.engine_steps, deadline)
    write(report, out)
    shared = report["shared_prefix"]
    if not shared["check_passed"]:
        raise SystemExit(
            f"shared prefix / attention kernels: a layout differs from whole rows on SDPA: {shared['rows']}"
        )


def write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
