"""The Hub: the model card written into ``<output_dir>/final/README.md`` at the end of a run,
and ``--push-to-hub``, which uploads that folder to ``hub_model_id`` when the run is done.

Whatever can be known before training is checked when the trainer is built
(:func:`check_push`: huggingface_hub importable, not offline, a token, a valid repository
name), so that a long run does not end unpushed for a reason known at its start. A push that
fails at the end (no network, permission) is a :class:`HubPushError` that says the model is
safe on disk and how to upload it later.
"""

import dataclasses
import os
import shlex

from grpo_fast.spec import option_default

CARD = "README.md"  # the model card's file name, which the Hub reads


class HubPushError(ValueError):
    """push_to_hub cannot or could not upload the final model (the CLI prints it as one line)."""


# ---------------------------------------------------------------- the push
def repo_name(config, output_dir: str) -> str:
    """push_to_hub's repository: ``hub_model_id``, else the output folder's name (TRL's rule;
    without ``user/`` the Hub puts it under the token's account)."""
    return config.hub_model_id or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))


def _offline_variable() -> str | None:
    """The variable that puts the Hub client offline, read now (huggingface_hub reads it once,
    at import: a variable set later would still make the push fail)."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def _command(args: str) -> str:
    """A command of the installed huggingface_hub's CLI: ``hf`` since 0.34, before it ``huggingface-cli``."""
    import huggingface_hub
    from packaging.version import Version

    new = Version(huggingface_hub.__version__) >= Version("0.34")
    if args == "login":
        return "hf auth login" if new else "huggingface-cli login"
    return f"{'hf' if new else 'huggingface-cli'} {args}"


def upload_command(repo_id: str, final: str) -> str:
    """The shell command that uploads the folder ``final`` to ``repo_id`` later."""
    return _command(f"upload {shlex.quote(repo_id)} {shlex.quote(final)}")


def check_push(config) -> None:
    """Raises :class:`HubPushError` when ``config.push_to_hub`` could not push at the end of the
    run for a reason known now: huggingface_hub missing, offline mode, no token, a repository
    name the Hub refuses. Nothing is sent to the Hub (the token is not verified)."""
    if not config.push_to_hub:
        return  # hub_model_id alone is ignored, as in TRL
    try:
        import huggingface_hub
    except ImportError as exc:
        raise HubPushError("push_to_hub needs the huggingface_hub package: pip install huggingface_hub") from exc
    output_dir = config.output_dir or "run"  # None: runs/<time>, a valid name
    repo = repo_name(config, output_dir)
    final = os.path.join(config.output_dir, "final") if config.output_dir else "OUTPUT_DIR/final"
    later = f"leave out push_to_hub and upload {final} after the run (`{upload_command(repo, final)}`)"
    offline = _offline_variable()
    if offline:
        raise HubPushError(
            f"push_to_hub: {offline} is set (offline mode), so the model cannot be pushed to {repo!r} at the end "
            f"of the run: unset {offline}, or {later}"
        )
    try:
        huggingface_hub.utils.validate_repo_id(repo)
    except ValueError as exc:
        source = "hub_model_id" if config.hub_model_id else "the output folder's name (hub_model_id unset)"
        raise HubPushError(
            f"push_to_hub: {source} {repo!r} is not a Hub repository name ({exc}); pass --hub-model-id user/name"
        ) from exc
    # rank 0 alone pushes: another node's rank need not hold a token
    if int(os.environ.get("RANK", 0)) == 0 and huggingface_hub.get_token() is None:
        raise HubPushError(
            f"push_to_hub needs a Hugging Face token with write access to push to {repo!r}: run `{_command('login')}` "
            f"or set HF_TOKEN, or {later}"
        )


def push(config, output_dir: str, final: str) -> str:
    """Creates the repository (if new) and uploads the folder ``final`` to it; returns the
    repository's URL. Any failure is a :class:`HubPushError` that names the repository and the
    cause, and says how to upload ``final`` later."""
    from huggingface_hub import HfApi

    repo = repo_name(config, output_dir)
    # the endpoint as the environment says now (huggingface_hub's constant is read at import)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT", "").rstrip("/") or None)
    try:
        url = api.create_repo(repo, exist_ok=True)
        repo = url.repo_id  # with the account's name when hub_model_id had none
        api.upload_folder(folder_path=final, repo_id=repo, commit_message="grpo-fast: final model and card")
    except Exception as exc:
        cause = (str(exc).strip().splitlines() or [""])[0]
        account = "" if "/" in repo else " (under your account)"
        raise HubPushError(
            f"push_to_hub: could not push to the Hub repository {repo!r}{account} at {api.endpoint} "
            f"({type(exc).__name__}: {cause}); the model is safe in {final}: push it later with "
            f"`{upload_command(repo, final)}`"
        ) from exc
    return str(url)


# ---------------------------------------------------------------- the model card
def _is_hub_name(name: str | None, *, dataset: bool = False) -> bool:
    from grpo_fast.model_files import is_model_file
    from grpo_fast.tasks.datasets import is_dataset_path, is_local_path

    if dataset:
        return name is not None and not is_dataset_path(name)
    return name is not None and not is_local_path(name) and not is_model_file(name)


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def command_line(config) -> str:
    """``grpo-fast train`` with a flag for every setting of ``config`` that is not the default."""
    args = ["grpo-fast", "train"]
    for field in dataclasses.fields(config):
        default = option_default(field)
        value = getattr(config, field.name)
        if value == default and type(value) is type(default):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]  # None is the word None, as the flags take it
    return shlex.join(args)


def model_card(config, history: list, *, reward_names=None, model_given: bool = False, rows_given: bool = False) -> str:
    """The model card (README.md) of a run of ``config`` whose metrics rows are ``history``
    (metrics.jsonl's; the last one's are the final metrics): YAML front matter for the Hub,
    then what was trained on what, with which rewards and settings, how far, and how."""
    import yaml

    import grpo_fast
    from grpo_fast.model_files import is_model_file
    from grpo_fast.tasks import task_module

    model, dataset, task = config.model, config.dataset, config.task or "arithmetic"
    meta = {}
    if _is_hub_name(model) and not model_given:
        meta["base_model"] = model
    if _is_hub_name(dataset, dataset=True) and not rows_given:
        meta["datasets"] = [dataset]
    meta["library_name"] = "peft" if config.lora_r else "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["grpo", "grpo-fast"] + (["lora"] if config.lora_r else [])
    title = repo_name(config, config.output_dir or "grpo-fast-model").split("/")[-1]

    if model_given:
        base = "a model passed to `GRPOTrainer`" + (f" (`{model}`)" if model else "")
    elif model is None:
        base = f"the built-in task {task!r}'s model (a 2-layer Llama-style model, initialised with seed {config.seed}"
        base += ", then its documented warm start)" if task == "tool_arithmetic" else ")"
    elif _is_hub_name(model):
        revision = f" (revision `{config.model_revision}`)" if config.model_revision else ""
        base = f"[{model}](https://huggingface.co/{model}){revision}"
    elif is_model_file(model):
        base = f"the GGUF file `{model}`, dequantized to float32"
    else:
        base = f"the local folder `{model}`"
    if rows_given:
        data = "prompt rows passed to `GRPOTrainer`"
    elif dataset is None:
        kept = " (without its held-out rows, which the eval reads)" if config.eval_every else ""
        data = f"{task_module(config.task).__doc__.splitlines()[0].rstrip('.')}{kept}"
    else:
        name = (
            f"[{dataset}](https://huggingface.co/datasets/{dataset})"
            if _is_hub_name(dataset, dataset=True)
            else f"`{dataset}`"
        )
        parts = [f"config `{config.dataset_config}`"] if config.dataset_config else []
        parts.append(f"split `{config.dataset_split or 'train'}`")
        data = f"{name} ({', '.join(parts)})"
    names = list(reward_names or config.reward_funcs or [])
    weights = config.reward_weights or [1] * len(names)
    rewards = ", ".join(f"`{n}` (weight {_number(w)})" for n, w in zip(names, weights)) or "-"
    final = history[-1] if history else {}
    steps = final.get("step", 0)
    keys = ("group_size", "batch_size", "learning_rate", "beta", "loss_type", "max_new_tokens", "temperature")
    keys += ("lora_r",) if config.lora_r else ()
    settings = ", ".join(f"{k} {_number(getattr(config, k))}" for k in keys)

    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {title}",
        "",
        f"Trained with GRPO by grpo-fast {grpo_fast.__version__}.",
        "",
        f"- **Base model**: {base}",
        f"- **Dataset**: {data}",
        f"- **Rewards**: {rewards}",
        *([f"- **Tools**: {', '.join(f'`{t}`' for t in config.tools)}"] if config.tools else []),
        f"- **Steps trained**: {steps} of {config.steps}",
        f"- **Settings**: {settings}",
        "",
    ]
    if final:
        shown = ["reward_mean", "reward_std", *(k for k in final if k.startswith("rewards/")), "kl"]
        shown += ["completion_len_mean", *(k for k in final if k.startswith("eval/"))]
        lines += [f"## Final metrics (step {steps})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {key} | {_number(final[key])} |" for key in shown if key in final]
        if any(k.startswith("eval/") for k in final):
            eval_data = (
                f"`{config.eval_dataset}` (split `{config.eval_split}`)"
                if config.eval_dataset
                else f"the {task} task's held-out rows"
            )
            temperature = config.eval_temperature or config.temperature
            lines += [
                "",
                f"eval: {config.eval_samples} samples per prompt of {eval_data} at temperature "
                f"{_number(temperature)}; a sample passes at combined reward >= {_number(config.eval_pass_threshold)}.",
            ]
        lines.append("")
    lines += ["## Training", "", "```bash", command_line(config), "```", ""]
    if model_given or rows_given:
        lines += [
            "(through the Python API: the model or prompts were passed to `GRPOTrainer`, not named by the settings)",
            "",
        ]
    return "\n".join(lines)


def write_card(folder: str, config, history: list, **options) -> str:
    """Writes :func:`model_card` to ``folder/README.md``; returns its path."""
    path = os.path.join(folder, CARD)
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_card(config, history, **options))
    return path
