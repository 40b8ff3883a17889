"""TRL's GRPOTrainer three ways: stock, with ``use_liger_kernel=True``, and grpo_fast's subclass.

The same tiny-hidden Llama with a real vocabulary (151936, Qwen2.5's) and the same batch of
completions (512 tokens each, EOS suppressed), TRL 1.16's default loss (dapo, beta 0). Two
phases of a GRPO step, each measured in a fresh process per implementation:

- ``update``: ``compute_loss`` + backward + AdamW step on the generated batch (what grpo_fast
  replaces: the loss from the last hidden states);
- ``logprobs``: the no-grad log-prob pass (old-policy / reference log-probs).

Time: median (20% / 80%) of ``--repeats`` calls after one warm-up; rounds alternate the
implementations so that load from other processes hits all alike. Peak: on CPU the growth of
the process's peak resident set over its resident set during one call in steady state (the
peak is reset after the warm-up, so one-off allocations such as AdamW's state are not
counted); on CUDA ``max_memory_allocated`` above what was allocated before the call.

    python benchmarks/bench_trl.py                      # CPU, writes benchmarks/results/trl_cpu.json
    python benchmarks/bench_trl.py --device cuda        # GPU (bf16), writes trl_cuda.json
    python benchmarks/bench_trl.py --dry-run            # tiny shapes, every code path, nothing saved
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
IMPLEMENTATIONS = ("trl", "trl_liger", "grpo_fast")
PHASES = ("update", "logprobs")


def build(config: dict):
    """(trainer, the generated batch) of one implementation."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig
    from trl import GRPOTrainer as StockTrainer

    from grpo_fast.integrations.trl import GRPOTrainer
    from grpo_fast.tasks.arithmetic import arithmetic_reward, build_dataset, build_model, build_tokenizer

    torch.set_num_threads(config["threads"])
    tokenizer = build_tokenizer(vocab_size=config["vocab"])
    folder = tempfile.mkdtemp(prefix="bench-trl-model-")
    model = build_model(
        tokenizer,
        seed=0,
        hidden_size=config["hidden"],
        intermediate_size=2 * config["hidden"],
        max_position_embeddings=config["length"] + 16,
    )
    model.save_pretrained(folder)
    cuda = config["device"] == "cuda"
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-run-"),
        use_cpu=not cuda,
        bf16=cuda,
        report_to="none",
        per_device_train_batch_size=config["batch"],
        num_generations=config["group"],
        max_completion_length=config["length"],
        generation_kwargs={"min_new_tokens": config["length"]},
        use_liger_kernel=config["impl"] == "trl_liger",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        model_init_kwargs={"dtype": "bfloat16"} if cuda else None,
    )
    cls = GRPOTrainer if config["impl"] == "grpo_fast" else StockTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=folder,
            reward_funcs=arithmetic_reward,
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_list(build_dataset(num_rows=64, seed=0)),
        )
    trainer.current_gradient_accumulation_steps = 1  # set by train() otherwise
    if args.use_liger_kernel:  # what train() does first
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, args.liger_kernel_config)
    rows = [trainer.train_dataset[i // config["group"]] for i in range(config["batch"])]
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(rows)
    return trainer, batch


def worker(config: dict) -> dict:
    import torch

    from grpo_fast.bench.measure import cuda_peak_extra_bytes, peak_rss_growth, quantiles

    trainer, batch = build(config)
    model, cuda = trainer.model, config["device"] == "cuda"
    completion_tokens = int(batch["completion_mask"].sum())
    if config["phase"] == "update":
        optimizer = trainer.create_optimizer()

        def step():
            trainer.compute_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)

        def step():
            with torch.no_grad():
                trainer._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].shape[1])

    def synced():
        step()
        if cuda:
            torch.cuda.synchronize()

    synced()  # warm-up: AdamW's state, the gradients, kernels compiled
    start = time.perf_counter()
    # reset the high-water mark first: the warm-up call's peak must not hide the measured one's
    peak = cuda_peak_extra_bytes(synced, "cuda") if cuda else peak_rss_growth(synced, reset=True)
    samples = [time.perf_counter() - start]  # the peak's call is the first timed one
    for _ in range(config["repeats"] - 1):
        start = time.perf_counter()
        synced()
        samples.append(time.perf_counter() - start)
    return {**quantiles(samples), "peak_bytes": peak, "completion_tokens": completion_tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--length", type=int, default=512, help="completion tokens (EOS suppressed)")
    parser.add_argument("--batch", type=int, default=8, help="completions per step")
    parser.add_argument("--group", type=int, default=8, help="num_generations")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one round, nothing written")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/trl_<device>.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.dry_run:
        args.vocab, args.hidden, args.length, args.batch, args.group, args.repeats, args.rounds = (
            512,
            16,
            16,
            4,
            4,
            1,
            1,
        )

    import transformers

    from grpo_fast.bench.measure import machine_info, run_isolated

    try:
        import trl
    except ImportError:  # e.g. the GPU image, where nothing is installed: say so, fail nothing else
        print("TRL is not installed (pip install 'grpo-fast[trl]'): nothing to compare")
        return

    base = {
        k: getattr(args, k) for k in ("device", "vocab", "hidden", "length", "batch", "group", "repeats", "threads")
    }
    runs = {(impl, phase): [] for phase in PHASES for impl in IMPLEMENTATIONS}
    for _ in range(args.rounds):
        for phase in PHASES:
            for impl in IMPLEMENTATIONS:
                start = time.perf_counter()
                out = run_isolated([sys.executable, os.path.abspath(__file__)], {**base, "impl": impl, "phase": phase})
                runs[impl, phase].append(out)
                shown = (
                    out.get("error")
                    or f"median {out['median_s'] * 1e3:.0f} ms, peak {out['peak_bytes'] / 2**20:.0f} MiB"
                )
                print(f"{phase:<9} {impl:<10} {shown}  ({time.perf_counter() - start:.0f} s)", flush=True)

    results = {}
    for (impl, phase), outs in runs.items():
        ok = [o for o in outs if "error" not in o]
        if not ok:
            results.setdefault(phase, {})[impl] = {"error": outs[0]["error"]}
            continue
        times = [o["median_s"] for o in ok]
        results.setdefault(phase, {})[impl] = {
            "median_s": statistics.median(times),
            "round_medians_s": times,
            "peak_bytes": max(o["peak_bytes"] for o in ok),
            "completion_tokens": ok[0]["completion_tokens"],
        }
    for phase, rows in results.items():
        stock = rows.get("trl", {})
        for row in rows.values():
            if "error" not in row and "error" not in stock:
                row["time_vs_trl"] = row["median_s"] / stock["median_s"]
                row["peak_vs_trl"] = row["peak_bytes"] / stock["peak_bytes"]

    print("\n| phase | implementation | median step | time / TRL | peak | peak / TRL |\n|---|---|---|---|---|---|")
    for phase, rows in results.items():
        for impl, row in rows.items():
            if "error" in row:
                print(f"| {phase} | {impl} | error: {row['error'][:80]} | | | |")
                continue
            print(
                f"| {phase} | {impl} | {row['median_s'] * 1e3:.0f} ms | {row['time_vs_trl']:.2f} | "
                f"{row['peak_bytes'] / 2**20:.0f} MiB | {row['peak_vs_trl']:.2f} |"
            )
    report = {
        "benchmark": "TRL GRPOTrainer update and log-prob pass: stock, use_liger_kernel, grpo_fast.integrations.trl",
        "setup": {**base, "rounds": args.rounds, "loss": "TRL defaults (dapo, beta 0)", "dry_run": args.dry_run},
        "versions": {"transformers": transformers.__version__, "trl": trl.__version__},
        "machine": machine_info(),
        "results": results,
    }
    output = args.output
    if output is None and args.dry_run:
        output = os.path.join(os.environ.get("OUT") or tempfile.mkdtemp(), f"trl_{args.device}_dryrun.json")
    output = output or os.path.join(RESULTS, f"trl_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
