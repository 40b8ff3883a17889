"""What PPO's critic costs: peak memory and time of a training step, PPO against GRPO.

This is the one benchmark inside the installed package: ``grpo-fast bench memory`` is a
command a user runs on their own model (``--model PATH``) from an install without the
repository; the other benchmarks are scripts in ``benchmarks/`` (``benchmarks/bench_memory.py``
runs this one with the repository's result paths).

Each configuration runs full training steps of the trainer itself (everything after
sampling: reference log-probs when beta != 0, the critic's values and GAE for PPO, group
advantages for GRPO, forward, loss, backward, gradient clipping, AdamW step) on the same
synthetic rollout batch, in its own fresh process:

    ppo                policy + value model (GRPOTrainer with the PPO strategy, ``ppo.py``; fused
                       ops on the policy side)
    grpo_eager         GRPOTrainer with the reference loss on full logits (GRPO_FAST_BACKEND=reference)
    grpo_fused         GRPOTrainer with grpo_fast.grpo_loss
    grpo_fused_linear  GRPOTrainer with grpo_fast.fused_linear_grpo_loss (no [B, T, V] logits)

and, when named in ``configs``, grpo_fused with its CPU vocabulary sweep on one route:
``grpo_fused_compiled`` (inductor's kernels) or ``grpo_fused_chunked`` (eager chunks).
grpo_fused picks the route by the logits' size (``ops/_backend.py``).

Peak memory is measured, not estimated, in the steady state: the peak of the second step,
whose backward runs while AdamW's moments (created by the first step) are held. On CUDA it is
``torch.cuda.max_memory_allocated``; on CPU the step's peak resident set (the kernel's
high-water mark reset just before the step, so that the libraries' loading cannot hide it) over
the RSS from just before the model is built, with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_)
so that every freed tensor leaves the resident set, as it leaves CUDA's allocated bytes;
otherwise the peak also counts heap fragments that the allocator keeps. Parameters, gradients
and optimizer states are inside the peak; the analytic columns beside it are their exact
sizes and that of one micro-batch's logits tensor; ``rest`` is what remains (activations,
logits and temporaries). The first step's own peak is reported beside it: it is lower when
the moments are created after the backward has freed its activations. Step time is the
median of ``repeats`` further steps.

With ``--nproc N`` each GRPO configuration runs under torchrun on N processes (``--parallel
ddp`` or ``fsdp``), each rank holding its share of the batch: what is reported is the peak of
each rank, and ``peak_bytes`` is the largest; the state columns are one rank's (under FSDP2
its shards). PPO runs in one process only (left out by default).

    grpo-fast bench memory --preset 100m --json memory.json --plot memory.png
    grpo-fast bench memory --model ./my-llama --batch 16
    grpo-fast bench memory --model Qwen/Qwen2.5-0.5B-Instruct --preset qwen2.5-0.5b
    grpo-fast bench memory --preset 100m --configs grpo_fused --nproc 2 --parallel fsdp
    python -m grpo_fast.bench.memory --preset tiny
"""

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from grpo_fast.bench.memory_step import SWEEP_ROUTES, worker
from grpo_fast.trainer.choices import PARALLEL

CONFIGS = ("ppo", "grpo_eager", "grpo_fused", "grpo_fused_linear")
ALL_CONFIGS = CONFIGS + tuple(SWEEP_ROUTES)

# Model shapes (Llama-style unless ``model_type`` says otherwise, tied embeddings), the rollout
# batch and the micro-batch (sequences per forward/backward, None = all) of each preset. ``100m``
# accumulates gradients over four micro-batches, as a run whose memory is tight does, so the
# model's states are most of it.
PRESETS = {
    "tiny": dict(
        model=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=1024,
        ),
        batch=8,
        micro_batch=None,
        prompt_length=8,
        completion_length=16,
    ),
    "100m": dict(
        model=dict(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=10,
            num_attention_heads=12,
            num_key_value_heads=12,
            vocab_size=32000,
        ),
        batch=8,
        micro_batch=2,
        prompt_length=32,
        completion_length=96,
    ),
    # Qwen2.5-0.5B's shape (Qwen2: q/k/v biases, 2 KV heads, tied 151,936-token vocabulary), all
    # 24 layers: PPO fits in 24 GiB on CPU (about 16 GiB). A GSM8K batch of one group: prompts
    # with the recipe's system prompt, answers of 129-256 tokens (GSM8K's are mostly under 300),
    # in one micro-batch as in recipes/gsm8k_qwen2.5_0.5b.yaml, whose micro-batches hold up to
    # 16,384 tokens; a group rather than the recipe's 16 keeps a CPU step near a minute.
    "qwen2.5-0.5b": dict(
        model=dict(
            model_type="qwen2",
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
        batch=4,
        micro_batch=None,
        prompt_length=128,
        completion_length=256,
    ),
    "1b": dict(  # TinyLlama-1.1B's shape; for a GPU (about 40 GB for PPO)
        model=dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
        batch=16,
        micro_batch=4,
        prompt_length=256,
        completion_length=512,
    ),
}
# glibc raises its mmap threshold after each large free, so later tensors come from the heap and
# freed ones stay resident; a fixed threshold keeps every tensor over 128 KiB in its own mapping.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def preset_settings(preset: str) -> dict:
    """A copy of ``PRESETS[preset]``; an unknown name is a ValueError listing the known ones."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return json.loads(json.dumps(PRESETS[preset]))


def check_causal_lm(path: str) -> None:
    """Raises ValueError unless ``path`` is a local folder holding a causal-LM config, or a Hub
    name (as the trainer's ``--model`` takes it) whose config is cached or can be fetched, or a
    GGUF file or ``package:<module>`` (converted here, once: ``grpo_fast/model_files.py``)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from grpo_fast.model_files import model_folder
    from grpo_fast.tasks.datasets import is_local_path

    path = model_folder(path)
    local = is_local_path(path)
    if local and (not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json"))):
        raise ValueError(f"model path {path!r} is not a model folder with a config.json (nothing is downloaded)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=local)
    except OSError as exc:
        raise ValueError(
            f"model {path!r}: offline or not found on the Hub ({str(exc).splitlines()[0]}); pass a local "
            "folder that from_pretrained reads, or connect and unset HF_HUB_OFFLINE"
        ) from exc
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = config.architectures or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        architectures and not causal.intersection(architectures)
    ):
        raise ValueError(
            f"model path {path!r} is not a causal LM (model_type {config.model_type!r}, "
            f"architectures {architectures}): the benchmark trains a policy that predicts next tokens"
        )


def run_memory_benchmark(
    *,
    preset: str = "100m",
    model: str | None = None,
    batch: int | None = None,
    prompt_length: int | None = None,
    completion_length: int | None = None,
    micro_batch: int | None = None,
    group_size: int = 4,
    beta: float = 0.0,
    configs=None,
    repeats: int = 2,
    jobs: int = 1,
    nproc: int = 1,
    parallel: str = "ddp",
    device: str = "auto",
    json_path: str | None = None,
    plot_path: str | None = None,
    echo=print,
) -> dict:
    """Runs each configuration in a fresh process; returns ``{config: {"peak_bytes", "step_s", ...},
    "meta": {...}}`` and writes it to ``json_path`` and a bar chart to ``plot_path`` when given.

    ``jobs`` > 1 runs that many configurations at once: each peak is its own process's and
    stays valid, but the step times then share the CPU and are not comparable. ``nproc`` > 1
    runs each GRPO configuration under torchrun on that many processes (``parallel``: ddp or
    fsdp); PPO, which runs in one process, is then left out (naming it is a ValueError).
    ``model`` (a causal LM: a local folder, or a Hub name that ``from_pretrained`` fetches)
    replaces the preset's model; the preset still gives the batch shape unless ``batch``,
    ``prompt_length`` or ``completion_length`` override it.
    """
    from grpo_fast.bench.measure import machine_info, run_isolated

    settings = preset_settings(preset)
    if model is not None:
        check_causal_lm(model)
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    configs = list((CONFIGS if nproc == 1 else CONFIGS[1:]) if configs is None else configs)
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; choose from {list(ALL_CONFIGS)}")
    if nproc > 1 and "ppo" in configs:
        raise ValueError(f"the PPO baseline runs in one process: leave ppo out of configs with nproc={nproc}")
    overrides = dict(
        batch=batch, micro_batch=micro_batch, prompt_length=prompt_length, completion_length=completion_length
    )
    for key, value in overrides.items():
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
            settings[key] = value
    if settings["batch"] % group_size:
        raise ValueError(f"batch={settings['batch']} must be divisible by group_size={group_size}")
    if settings["micro_batch"] is not None and settings["micro_batch"] > settings["batch"]:
        raise ValueError(f"micro_batch must be in [1, batch={settings['batch']}], got {settings['micro_batch']!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    if (settings["batch"] // group_size) % nproc:
        raise ValueError(
            f"batch={settings['batch']} holds {settings['batch'] // group_size} groups of {group_size}, which must be "
            f"divisible by nproc={nproc} (each process trains whole groups)"
        )
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")

    import grpo_fast

    spec = dict(
        settings,
        model_path=model,
        preset=preset,
        group_size=group_size,
        beta=beta,
        repeats=repeats,
        jobs=jobs,
        nproc=nproc,
        parallel=parallel,
        device=device,
    )
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]

    def run(name):
        if name == "grpo_fused_linear" and not hasattr(grpo_fast, "fused_linear_grpo_loss"):
            result = {"error": "grpo_fast.fused_linear_grpo_loss is not available in this install"}
        else:
            argv = [*launcher, "-m", "grpo_fast.bench.memory"]
            result = run_isolated(argv, dict(spec, config=name), env=dict(os.environ, **MALLOC_ENV))
        echo(f"{name}: {result}")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(configs, pool.map(run, configs)))
    results["meta"] = dict(settings=spec, machine=machine_info(), ratios=_ratios(results))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    if plot_path:
        plot_results(results, plot_path)
    return results


def _ratios(results: dict) -> dict:
    """Peak of each configuration over PPO's, and each fused one's over grpo_eager's, when both ran."""

    def peak(name):
        return results.get(name, {}).get("peak_bytes")

    ratios = {f"{name}/ppo": peak(name) / peak("ppo") for name in ALL_CONFIGS[1:] if peak(name) and peak("ppo")}
    for name in ALL_CONFIGS[2:]:
        if peak(name) and peak("grpo_eager"):
            ratios[f"{name}/grpo_eager"] = peak(name) / peak("grpo_eager")
    return ratios


def table_rows(results: dict) -> list:
    """One row of formatted columns per configuration (MB = 2**20 bytes)."""

    def mb(x):
        return f"{x / 2**20:.0f}"

    ppo = results.get("ppo", {}).get("peak_bytes")
    rows = []
    for name in ALL_CONFIGS:
        res = results.get(name)
        if res is None:
            continue
        if "error" in res:
            rows.append({"config": name, "peak MB": f"error: {res['error']}"})
            continue
        rows.append(
            {
                "config": name,
                "peak MB": mb(res["peak_bytes"]),
                "x ppo": f"{res['peak_bytes'] / ppo:.3f}" if ppo else "-",
                "1st step MB": mb(res["first_step_peak_bytes"]),
                "step s": f"{res['step_s']:.2f}",
                "params MB": mb(res["params_bytes"]),
                "grads MB": mb(res["grads_bytes"]),
                "optimizer MB": mb(res["optimizer_bytes"]),
                "logits MB": mb(res["logits_bytes"]),
                "rest MB": mb(res["rest_bytes"]),
                "rank peaks MB": ", ".join(mb(r["peak_bytes"]) for r in res.get("ranks", [res])),
            }
        )
    return rows


TABLE_COLUMNS = [
    "config",
    "peak MB",
    "x ppo",
    "1st step MB",
    "step s",
    "params MB",
    "grads MB",
    "optimizer MB",
    "logits MB",
    "rest MB",
    "rank peaks MB",
]


def plot_results(results: dict, path: str) -> None:
    """Stacked bars of the measured peak: parameters, gradients, optimizer states, the rest."""
    from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend is left alone

    names = [n for n in ALL_CONFIGS if n in results and "error" not in results[n]]
    parts = [
        ("params_bytes", "parameters"),
        ("grads_bytes", "gradients"),
        ("optimizer_bytes", "optimizer states"),
        ("rest_bytes", "activations, logits, temporaries"),
    ]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    bottom = [0.0] * len(names)
    for key, label in parts:
        heights = [max(results[n][key], 0) / 2**20 for n in names]
        ax.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, n in enumerate(names):
        res = results[n]
        ax.annotate(
            f"{res['peak_bytes'] / 2**20:.0f} MB\n{res['step_s']:.2f} s/step",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    settings = results["meta"]["settings"]
    model = settings["model_path"] or f"preset {settings['preset']}"
    if settings.get("nproc", 1) > 1:  # older JSON has no nproc
        model += f", per rank of {settings['nproc']} ({settings['parallel']})"
    ax.set_title(
        f"peak memory of a training step ({model}, {results[names[0]]['device'] if names else ''})\n"
        f"batch {settings['batch']} x ({settings['prompt_length']} + {settings['completion_length']}) tokens, "
        f"micro-batch {settings['micro_batch'] or settings['batch']}, beta {settings['beta']}",
        fontsize=9,
    )
    ax.set_ylabel("MB (measured peak)")
    ax.set_ylim(0, max(bottom, default=1) * 1.45)  # headroom for the labels and the legend
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``grpo-fast bench memory``."""
    parser.add_argument("--preset", default="100m", help=f"model and batch shape: {', '.join(PRESETS)} (default 100m)")
    parser.add_argument(
        "--model",
        help="a causal LM to measure instead of the preset's: a local folder or a Hub name (from_pretrained); "
        "the batch shape stays the preset's",
    )
    parser.add_argument("--batch", type=int, help="sequences per step (default: the preset's)")
    parser.add_argument("--prompt-length", type=int, help="prompt tokens per sequence (default: the preset's)")
    parser.add_argument("--completion-length", type=int, help="completion tokens per sequence (default: the preset's)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default: the preset's)")
    parser.add_argument("--group-size", type=int, default=4, help="G, completions per prompt (default 4)")
    parser.add_argument(
        "--beta", type=float, default=0.0, help="KL weight; > 0 adds a frozen reference model (default 0)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        help=f"of {' '.join(ALL_CONFIGS)} (default: the first four; with --nproc > 1 all but ppo)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the measured one (default 2)")
    parser.add_argument("--jobs", type=int, default=1, help="configurations at once (peaks stay valid, times do not)")
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes per GRPO configuration, under torchrun (default 1)"
    )
    parser.add_argument("--parallel", default="ddp", help=f"with --nproc > 1: {' or '.join(PARALLEL)} (default ddp)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a bar chart (PNG) here")


def command(args: argparse.Namespace) -> int:
    """Runs the benchmark from parsed arguments, prints the table; 0 on success, 1 if a configuration
    failed, 2 on bad input."""
    from grpo_fast.bench.measure import print_table

    try:
        results = run_memory_benchmark(
            preset=args.preset,
            model=args.model,
            batch=args.batch,
            prompt_length=args.prompt_length,
            completion_length=args.completion_length,
            micro_batch=args.micro_batch,
            group_size=args.group_size,
            beta=args.beta,
            configs=args.configs,
            repeats=args.repeats,
            jobs=args.jobs,
            nproc=args.nproc,
            parallel=args.parallel,
            device=args.device,
            json_path=args.json,
            plot_path=args.plot,
            echo=lambda line: print(line, file=sys.stderr),
        )
    except ValueError as exc:
        print(f"grpo-fast bench memory: error: {exc}", file=sys.stderr)
        return 2
    print_table(table_rows(results), TABLE_COLUMNS)
    for key, value in results["meta"]["ratios"].items():
        print(f"peak {key}: {value:.3f}")
    for path in (args.json, args.plot):
        if path:
            print(f"wrote {path}")
    return 1 if any("error" in results[n] for n in ALL_CONFIGS if n in results) else 0


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))  # under torchrun the worker prints and exits itself
        return 0
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
