"""The names a run's settings choose from, and the checks that a name can be used on this
machine, where nothing heavy is imported: the config validates against them before torch
loads, and the modules that act on a name read it here.

A new engine is a module of ``rollout/engines/`` and a row of :data:`ENGINES`; a new tracker an
adapter of ``run/trackers.py`` and a row of :data:`TRACKERS`.
"""

import importlib.util

# name -> "module:Class" of a generation engine, imported only when picked (it may need an
# optional package)
ENGINES = {
    "hf": "grpo_fast.trainer.rollout.engines.hf:HFGenerator",
    "sampler": "grpo_fast.trainer.rollout.engines.sampler:Sampler",
    "vllm": "grpo_fast.trainer.rollout.engines.vllm:VLLMGenerator",
}
# --vllm-mode: where the vllm engine runs, the engine of each ("vllm" above is the colocated one)
VLLM_MODES = {
    "colocate": ENGINES["vllm"],
    "server": "grpo_fast.trainer.rollout.engines.vllm_server:VLLMServerGenerator",
}
PRECISIONS = ("auto", "bf16", "fp32")
# the kernels that attend a packed forward (grpo_fast.packing.ATTENTIONS: the same names)
ATTENTION_KERNELS = ("sdpa", "flex")
PARALLEL = ("ddp", "fsdp")  # under torchrun: each rank a replica, or a shard (FSDP2)
LR_SCHEDULES = ("cosine", "linear", "constant")
SAVE_FAILURES = ("stop", "continue")  # what a run does when a checkpoint cannot be written
# the signals a run may take as preemption: the schedulers' (SLURM: SIGTERM, --signal=USR1@90;
# Kubernetes: SIGTERM; LSF: SIGUSR2, SIGXCPU) and the terminal's; SIGALRM is the grace timer's own
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXCPU", "SIGPWR")
# tracker name -> the library it needs installed (the pip extra of the tracker's name installs it)
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def check_device(name: str, value: str) -> None:
    """Raises ValueError unless ``value`` names a device of this machine: cpu, cuda, cuda:N."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} must be a device such as 'cpu' or 'cuda:1', got {value!r}") from exc
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"{name} must be 'cpu' or a CUDA device, got {value!r}")
    count = torch.cuda.device_count()
    if count == 0 or (device.index or 0) >= count:
        raise ValueError(f"{name}={value!r} does not exist: this machine has {count} CUDA device(s)")


class TrackerUnavailable(ImportError):
    """A tracker named in ``report_to`` whose library is not installed."""


def check_trackers(names) -> None:
    """ValueError for an unknown name (listing the valid ones), :class:`TrackerUnavailable`
    (naming the pip extra) for one whose library is not installed. Imports nothing."""
    if names is None:
        return
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"report_to must be a list of tracker names, got {names!r}")
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r}; valid trackers are {list(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise TrackerUnavailable(
                f'report_to={name!r} needs the {TRACKERS[name]!r} package: pip install "grpo-fast[{name}]"'
            )


def check_signals(name: str, value) -> None:
    """ValueError unless ``value`` is a list of names from :data:`PREEMPTION_SIGNALS`."""
    if not isinstance(value, list) or not all(v in PREEMPTION_SIGNALS for v in value):
        raise ValueError(f"{name} must be a list of signal names from {PREEMPTION_SIGNALS}, got {value!r}")
