"""``grpo-fast``: the command-line entry point.

    grpo-fast train                                  # the built-in demo: a tiny model learns addition
    grpo-fast train --model PATH --dataset PATH      # a real causal LM on a prompt dataset
    grpo-fast train --config run.yaml --steps 500    # YAML config, flags override it
    grpo-fast train --output runs/x --resume         # continue a run from its last checkpoint
    grpo-fast train --output runs/x --resume auto    # ... from its last valid one, or from the start
    grpo-fast train --report-to tensorboard --eval-every 50   # trackers; held-out evaluation
    grpo-fast eval --model runs/x/final -n 8         # evaluate a model folder (a run's: its config's settings)
    grpo-fast bench memory --preset 100m             # what PPO's critic costs next to GRPO (memory, time)
    grpo-fast serve PATH --port 8000                 # a vLLM server for --vllm-mode server (vLLM's flags after PATH)
    torchrun --nproc-per-node 8 -m grpo_fast train --model PATH ... [--parallel fsdp]   # many devices

Every field of :class:`GRPOConfig` is also a flag (``--learning-rate``, ``--beta``, ...).
Under torchrun every rank runs this; rank 0 alone prints the summary, and a rank's error is
printed with its rank. Exit status: 0 done; 2 an error of the run's input or files, in one line
(a bad setting, a reward that is not a number, a checkpoint that cannot be read or written, too
many non-finite steps); 75 preempted (a signal of ``--preemption-signals``), with a checkpoint
to ``--resume auto`` from.
"""

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import re
import sys
import types
import typing

from grpo_fast.spec import option_default
from grpo_fast.trainer.checks import check_model_source
from grpo_fast.trainer.config import TOPICS, GRPOConfig, read_yaml
from grpo_fast.trainer.trl_names import TRL_ALIASES, TRL_INSTEAD

BENCHMARKS = {
    "memory": "peak memory and step time of one training step: ppo, grpo_eager, grpo_fused, grpo_fused_linear"
}

# Short names the issue and README use for config fields.
_ALIASES = {"output_dir": ["--output"], "group_size": ["-G"]}
# grpo-fast eval's flags: config fields under the names an evaluation gives them.
EVAL_FLAGS = {
    "eval_samples": ["-n", "--samples"],
    "eval_temperature": ["--temperature"],
    "eval_pass_threshold": ["--pass-threshold"],
    "reward_funcs": ["--reward-funcs"],
    "reward_weights": ["--reward-weights"],
    "task": ["--task"],
    "tools": ["--tools"],
    "max_tool_calling_iterations": ["--max-tool-calling-iterations"],
    "max_tool_response_tokens": ["--max-tool-response-tokens"],
    "tool_timeout_s": ["--tool-timeout-s"],
    "environment": ["--environment"],
    "max_turns": ["--max-turns"],
    "environment_timeout_s": ["--environment-timeout-s"],
    "generator": ["--generator"],
    "model_revision": ["--model-revision"],
    "dataset_config": ["--dataset-config"],
    "eval_split": ["--eval-split"],
    "seed": ["--seed"],
    "max_new_tokens": ["--max-new-tokens"],
    "max_prompt_length": ["--max-prompt-length"],
    "prompt_column": ["--prompt-column"],
    "prompt_template": ["--prompt-template"],
    "answer_column": ["--answer-column"],
    "system_prompt": ["--system-prompt"],
    "batch_size": ["--batch-size"],
    "device": ["--device"],
    "precision": ["--precision"],
}


NONE = "None"  # what an Optional field's flag takes for None (a flag left out is None to argparse)


def _flag_type(field: dataclasses.Field):
    """(argparse type, nargs) for a config field: Optional[X] -> X or the word None, list ->
    nargs '+'."""
    annotation = field.type
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    base = args[0] if union and args else annotation
    if base is list or typing.get_origin(base) is list:
        return str, "+"
    if union and type(None) in typing.get_args(annotation) and base is not bool:

        def optional(text: str, base=base):
            return NONE if text == NONE else base(text)

        optional.__name__ = base.__name__  # argparse names the type in its errors
        return optional, None
    return base, None


def _number_or_str(text: str):
    """Reward weights and similar lists: numbers when they parse as numbers."""
    try:
        return float(text)
    except ValueError:
        return text


def flag_names(name: str) -> list:
    """The flags of config field ``name``: --name-with-dashes, its short names, TRL's names of it."""
    trl = [f"--{alias.replace('_', '-')}" for alias, ours in TRL_ALIASES.items() if ours == name]
    return [f"--{name.replace('_', '-')}", *_ALIASES.get(name, []), *trl]


def help_topics() -> dict:
    """``{topic: [field names]}``: every config field under its section's title (its help
    topic), in the sections' order (``config.TOPICS``), the fields in the config's."""
    out = {topic: [] for topic in TOPICS}
    for f in dataclasses.fields(GRPOConfig):
        out[f.metadata["topic"]].append(f.name)
    return out


def _add_field(group, field: dataclasses.Field, resolved: GRPOConfig | None = None) -> None:
    """A config field's flag (all its :func:`flag_names`), typed from the annotation; its help
    gives the default and, where ``resolved`` takes the value from another layer, that value
    and its layer."""
    names = flag_names(field.name)
    kind, nargs = _flag_type(field)
    shown = f"default: {option_default(field)}"
    source = resolved.sources[field.name] if resolved is not None else "default"
    if source != "default":
        shown += f"; this run: {getattr(resolved, field.name)}, from: {source}"
    common = dict(dest=field.name, default=None, help=f"{field.metadata['help']} ({shown})")
    if kind is bool:
        group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    elif nargs:
        element = _number_or_str if field.name == "reward_weights" else str
        group.add_argument(*names, nargs=nargs, type=element, **common)
    else:
        group.add_argument(*names, type=kind, metavar=field.name.upper(), **common)


class _TRLOnly(argparse.Action):
    """A TRL flag with no setting of the same meaning here: an error that says what to use."""

    def __init__(self, *args, instead: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is TRL's and has no equivalent here: use {self.instead}")


def build_parser(resolved: GRPOConfig | None = None) -> argparse.ArgumentParser:
    """The CLI; ``resolved``: the config that train's --help shows the values of (:func:`_resolved`)."""
    # No abbreviations: argparse would otherwise read --lr as --lr-schedule.
    parser = argparse.ArgumentParser(prog="grpo-fast", description="Fast, lean GRPO training.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train a policy with GRPO (no arguments: the built-in demo)",
        usage="%(prog)s [--config FILE] [--resume] [--FLAG VALUE ...]",
        description="Train with GRPO. Without --model/--dataset: a tiny model learns single-digit "
        "addition on the CPU in about 15 seconds (2 cores).",
    )
    train.add_argument("--config", help="YAML file of config keys; flags given here override it")
    train.add_argument(
        "--resume",
        nargs="?",
        const="last",
        choices=("last", "auto"),
        help="continue the run in --output from its last checkpoint; 'auto': from its last valid one, or from the "
        "start when there is none (one job script, requeued after each preemption)",
    )
    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    for topic, names in help_topics().items():
        group = train.add_argument_group(topic, f"YAML section: {fields[names[0]].metadata['section']}")
        for name in names:
            _add_field(group, fields[name], resolved)
    for trl, instead in TRL_INSTEAD.items():
        train.add_argument(
            f"--{trl.replace('_', '-')}", nargs="?", action=_TRLOnly, instead=instead, help=argparse.SUPPRESS
        )
    evaluate = commands.add_parser(
        "eval",
        allow_abbrev=False,
        help="evaluate a model folder: mean rewards, pass@1 and pass@n on held-out prompts",
        description="Evaluate a model folder (a run's final/ or checkpoint model, or any local Hugging Face "
        "model) as training's --eval-every does. A folder inside a run (its config.yaml one level up) starts "
        "from that run's settings, so with its seed it gives the numbers the run logged at its last step.",
    )
    evaluate.add_argument("--model", required=True, help="the model: a folder (save_pretrained) or a Hub name")
    evaluate.add_argument(
        "--dataset",
        help="eval prompts, as train's --dataset; default: the run's eval_dataset, or the demo's held-out sums",
    )
    evaluate.add_argument("--output", default="eval.json", help="JSON file of the results (default: eval.json)")
    for name, flag in EVAL_FLAGS.items():
        field = GRPOConfig.__dataclass_fields__[name]
        kind, nargs = _flag_type(field)
        evaluate.add_argument(
            *flag, dest=name, type=str if nargs else kind, nargs=nargs, default=None, help=field.metadata["help"]
        )
    serve = commands.add_parser(
        "serve",
        help="start a vLLM server for --vllm-mode server: vllm serve MODEL with every flag training needs",
        description="Runs vllm serve MODEL with the weight-transfer backend and worker extension that training "
        "pushes its weights through, log-probs after temperature, and on a machine without CUDA float32 and "
        "whole-prompt prefills; the flags after MODEL are vLLM's own (--port 8000, --max-model-len 4096, ...) "
        "and win over these.",
    )
    serve.add_argument("model", help="the model: a folder or a Hub name, the policy's starting weights")
    serve.add_argument("flags", nargs=argparse.REMAINDER, help="vllm serve's flags")
    bench = commands.add_parser(
        "bench",
        help="benchmarks: grpo-fast bench memory (PPO's critic against GRPO)",
        description="\n".join(f"{name}: {text}" for name, text in BENCHMARKS.items()),
    )
    bench.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="its options (grpo-fast bench NAME --help)")
    return parser


def _latest_run(root: str = "runs"):
    runs = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    runs = [r for r in runs if os.path.isdir(os.path.join(r, "checkpoints"))]
    return max(runs, key=os.path.getmtime) if runs else None


def make_config(args: argparse.Namespace) -> GRPOConfig:
    """The layers, each later one winning: the defaults, the task's settings, the YAML file
    (or the resumed run's saved config), then the flags given."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)}
    overrides = {k: None if v == NONE else v for k, v in overrides.items() if v is not None}
    config_file = args.config
    if args.resume == "auto" and "output_dir" not in overrides:
        raise ValueError("--resume auto needs --output DIR: a requeued job must find the run it started")
    if args.resume:
        overrides.setdefault("output_dir", _latest_run())
        if overrides["output_dir"] is None:
            raise FileNotFoundError("--resume needs --output DIR (no run with checkpoints found in runs/)")
        saved = os.path.join(overrides["output_dir"], "config.yaml")
        if config_file is None and os.path.isfile(saved):
            config_file = saved
    file = [(f"file {config_file}", read_yaml(config_file))] if config_file is not None else []
    return GRPOConfig.from_layers(*file, ("flag", overrides))


def train(args: argparse.Namespace) -> int:
    config = make_config(args)  # validated before torch loads: a bad setting fails in a moment
    check_model_source(config)  # an unreachable Hub model too
    import torch

    from grpo_fast.trainer import GRPOTrainer, distributed
    from grpo_fast.trainer.run import faults

    if config.model is None and not torch.cuda.is_available():
        # The demo's matrices are 64 wide: one thread beats two that synchronise every op.
        torch.set_num_threads(1)
    trainer = GRPOTrainer(config)
    main_rank = trainer.runtime.ranks.is_main
    if args.resume:
        step = trainer.resume(auto=args.resume == "auto")
        if main_rank:
            print(f"{'resumed' if step else 'started'} {trainer.output_dir} at step {step}", file=sys.stderr)
    try:
        trainer.train()
    except faults.Preempted as stop:
        if main_rank:
            print(f"grpo-fast: {stop}", file=sys.stderr)
        distributed.shutdown()
        return stop.exit_status
    if main_rank:
        print(trainer.summary)
    distributed.shutdown()
    return 0


def eval_config(args: argparse.Namespace) -> GRPOConfig:
    """The run's saved config when ``--model`` lies in a run folder (else the defaults), with
    the model, the eval dataset and the flags given."""
    saved = os.path.join(os.path.dirname(os.path.abspath(args.model)), "config.yaml")
    values = {}
    if os.path.isfile(saved):
        import yaml

        with open(saved) as f:
            values = yaml.safe_load(f) or {}
    flags = {name: getattr(args, name) for name in EVAL_FLAGS}
    values.update({name: None if v == NONE else v for name, v in flags.items() if v is not None})
    if args.reward_weights is not None:
        values["reward_weights"] = [_number_or_str(w) for w in args.reward_weights]
    values.update(model=args.model, output_dir=None, report_to=None, eval_every=0)
    values["eval_dataset"] = args.dataset or values.get("eval_dataset")
    if not os.path.isfile(saved):  # no run: the task (its default rewards) is the eval dataset's
        values["dataset"] = args.dataset
    return GRPOConfig.from_dict(values)


def evaluate(args: argparse.Namespace) -> int:
    """Prints the eval metrics as a table (rank 0) and writes them, with the settings, as JSON."""
    import json

    config = eval_config(args)
    from grpo_fast.trainer import distributed
    from grpo_fast.trainer.run.evaluation import evaluate_model

    metrics = evaluate_model(config)
    if int(os.environ.get("RANK", 0)) == 0:
        width = max(len(key) for key in metrics)
        for key, value in metrics.items():
            print(f"{key:<{width}}  {'-' if value is None else f'{value:.4f}'}")
        settings = ("model", "eval_dataset", "reward_funcs", "eval_samples", "eval_temperature", "eval_pass_threshold")
        result = dict(metrics=metrics, **{k: getattr(config, k) for k in settings + ("seed", "generator")})
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    distributed.shutdown()
    return 0


def serve(args: argparse.Namespace) -> int:
    """Replaces this process with ``vllm serve`` (``vllm_server.serve_command``)."""
    from grpo_fast.trainer.rollout.engines.vllm_server import SERVE_ENV, serve_command

    command = serve_command(args.model, args.flags)
    print("grpo-fast: " + " ".join(command), file=sys.stderr, flush=True)
    os.execve(command[0], command, {**os.environ, **SERVE_ENV})


def dashed(argv: list) -> list:
    """``argv`` with each flag's name spelled with dashes: ``--learning_rate 0.1`` and
    ``--learning-rate=0.1`` alike, as Hugging Face's argument parser takes both spellings."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def _run_errors() -> tuple:
    """What a run's input can cause besides ValueError and FileNotFoundError: one line and
    exit code 2, not a traceback (imported when a run has failed: rollout's module loads torch)."""
    from grpo_fast.trainer.choices import TrackerUnavailable
    from grpo_fast.trainer.rollout.samples import RewardError
    from grpo_fast.trainer.run.checkpoint import CheckpointSaveError
    from grpo_fast.trainer.run.faults import NonFiniteSteps

    return RewardError, TrackerUnavailable, CheckpointSaveError, NonFiniteSteps


def _log_to_stderr() -> None:
    """The ``grpo_fast`` logger's info lines (what the run decided: its precision) on stderr, once."""
    logger = logging.getLogger("grpo_fast")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("grpo-fast: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _resolved(argv: list) -> GRPOConfig | None:
    """The config that train's flags in ``argv`` resolve to, the help flag aside, so that
    ``grpo-fast train --task guess_number --help`` shows each value this run would take and
    its layer; None when they do not resolve (the help then shows the defaults alone)."""
    rest = [arg for arg in argv if arg not in ("-h", "--help")]
    with contextlib.redirect_stderr(io.StringIO()):  # a flag's error is the real parse's to print
        try:
            args = build_parser().parse_args(rest)
            return make_config(args) if args.command == "train" else None
        except (SystemExit, ValueError, TypeError, FileNotFoundError):
            return None


def main(argv=None) -> int:
    argv = dashed(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_resolved(argv) if {"-h", "--help"} & set(argv) else None)
    args = parser.parse_args(argv)
    _log_to_stderr()
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "bench":  # the benchmark's module is imported only when it runs
            from grpo_fast.bench import memory

            return memory.main(args.options, prog=f"{parser.prog} bench {args.benchmark}")
        return evaluate(args) if args.command == "eval" else train(args)
    except Exception as exc:
        if not isinstance(exc, (ValueError, FileNotFoundError)) and not isinstance(exc, _run_errors()):
            raise
        rank = os.environ.get("RANK")  # set by torchrun
        where = f" (rank {rank})" if rank is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"grpo-fast: error{where}: {exc}{_flag_of(str(exc))}", file=sys.stderr)
        return 2


def _flag_of(message: str) -> str:
    """`` (flag --name)`` when ``message`` starts with a config field's name (the config's
    errors name the field first), else nothing."""
    name = re.match(r"\w+", message)
    fields = GRPOConfig.__dataclass_fields__
    return f" (flag --{name[0].replace('_', '-')})" if name and name[0] in fields else ""


if __name__ == "__main__":
    sys.exit(main())
