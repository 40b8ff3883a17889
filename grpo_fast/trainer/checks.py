"""The config's checks that span several settings: the turns of a rollout (task, tools,
environment, their limits and engine) and the asynchronous worker's, which
``GRPOConfig.validate`` calls; and that a Hub model can be reached. Each raises ValueError
naming the first inconsistent setting, before anything loads."""

from grpo_fast.environments import ENVIRONMENTS
from grpo_fast.model_files import gguf_path, is_model_file
from grpo_fast.tasks import TASKS
from grpo_fast.tasks.datasets import is_local_path
from grpo_fast.tools import TOOLS
from grpo_fast.trainer.choices import check_device


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def int_at_least(config, name: str, low: int, optional: bool = False) -> None:
    """ValueError unless field ``name`` is an int >= ``low`` (or None when ``optional``)."""
    value = getattr(config, name)
    ok = (optional and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= low)
    require(ok, f"{name} must be an int >= {low}{' or None' if optional else ''}, got {value!r}")


def check_turns(config, tools) -> None:
    """The task, ``tools`` (the config's, or the functions given to the trainer) and the
    environment: names that exist, limits in range, an engine that runs turns (a tool's function
    and schema, and an environment's class, are checked when the trainer resolves them, before
    the model loads)."""
    if config.task is not None:
        require(config.task in TASKS, f"task must be one of {tuple(TASKS)} or None, got {config.task!r}")
        require(
            config.dataset is None,
            f"task={config.task!r} is a built-in task's prompts and dataset={config.dataset!r} another's: give one",
        )
    environment = config.environment
    if environment is not None:
        require(
            not isinstance(environment, str) or environment in ENVIRONMENTS or ":" in environment,
            f"unknown environment {environment!r}; the built-in environments are {sorted(ENVIRONMENTS)}, or give "
            "package.module:Class or verifiers:<taskset id>",
        )
        int_at_least(config, "max_turns", 1, optional=True)
        require(
            config.environment_timeout_s > 0,
            f"environment_timeout_s must be > 0, got {config.environment_timeout_s!r}",
        )
    if tools is None and environment is None:
        return
    if tools is not None:
        require(
            isinstance(tools, list) and len(tools) > 0,
            f"tools must be a non-empty list of tool names or None, got {tools!r}",
        )
        for name in tools:
            require(
                not isinstance(name, str) or name in TOOLS or ":" in name,
                f"unknown tool {name!r}; the built-in tools are {sorted(TOOLS)}, or give package.module:function",
            )
    for name in ("max_tool_calling_iterations", "max_tool_response_tokens"):
        int_at_least(config, name, 1, optional=True)
    require(config.tool_timeout_s > 0, f"tool_timeout_s must be > 0, got {config.tool_timeout_s!r}")
    what = "tools" if environment is None else "an environment"
    require(
        not config.compile_generation,
        f"{what} do not work with compile_generation: a CUDA graph has fixed shapes, and the answers between "
        "turns change the batch's",
    )


def check_asynchrony(config) -> None:
    """max_staleness and what it needs: a generation device that exists, options that work
    with a worker sampling ahead of the trainer."""
    K = config.max_staleness
    require(
        isinstance(K, int) and not isinstance(K, bool) and K >= 0,
        f"max_staleness must be an int >= 0 (0 = synchronous rollouts), got {K!r}",
    )
    if not K:
        require(
            config.generation_device is None,
            f"generation_device={config.generation_device!r} needs max_staleness >= 1 (the synchronous loop "
            "samples on the trainer's device)",
        )
        return
    require(
        not config.dynamic_sampling,
        "max_staleness >= 1 does not work with dynamic_sampling: its refill rounds decide, from every rank's "
        "rewards, which prompts the next step samples",
    )
    require(
        config.parallel != "fsdp",
        "max_staleness >= 1 needs parallel='ddp': the worker samples with whole weights, which FSDP2 shards",
    )
    if config.generation_device is not None:
        check_device("generation_device", config.generation_device)


def check_model_source(config) -> None:
    """Raises ValueError, before anything loads, when ``config.model`` is a Hub name that
    cannot be reached: not in the local cache and offline (``HF_HUB_OFFLINE=1``, or no
    network), or not on the Hub (a typo, a private repository); or a GGUF file or
    ``package:<module>`` that is not there. Its config file is what is
    fetched (a few KB), so a reachable model costs nothing more here; only huggingface_hub is
    imported (the command line checks before torch and transformers load)."""
    if is_model_file(config.model):
        gguf_path(config.model)  # the file or package exists; it converts when the model loads
        return
    if config.model is None or is_local_path(config.model):
        return
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        hf_hub_download(config.model, "config.json", revision=config.model_revision)
    except (OSError, HfHubHTTPError) as exc:
        raise ValueError(
            f"model {config.model!r} (revision {config.model_revision or 'default'}): offline or not found on the "
            f"Hub ({str(exc).splitlines()[0]}); pass a local folder that from_pretrained reads "
            "(--model ./my-model), or connect and unset HF_HUB_OFFLINE"
        ) from exc
