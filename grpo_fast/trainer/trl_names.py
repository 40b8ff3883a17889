"""TRL's names for a run's settings: the ones that mean one of ours (taken as ours in a YAML
file and on the command line, ``--num_generations 8``), and the ones we have no setting for,
each with what to use instead."""

# TRL's names (GRPOConfig, TrainingArguments and its script arguments) that mean what one of
# ours does: taken as ours in a YAML file and on the command line (--num_generations 8).
TRL_ALIASES = {
    "num_generations": "group_size",
    "max_steps": "steps",
    "epsilon": "eps_low",
    "epsilon_high": "eps_high",
    "sapo_temperature_pos": "sapo_tau_pos",
    "sapo_temperature_neg": "sapo_tau_neg",
    "importance_sampling_level": "importance_sampling",
    "use_bias_correction_kl": "kl_bias_correction",
    "scale_rewards": "advantage_scale",
    "lr_scheduler_type": "lr_schedule",
    "save_steps": "save_every",
    "save_total_limit": "keep_checkpoints",
    "eval_steps": "eval_every",
    "vllm_max_model_length": "vllm_max_model_len",
    "vllm_server_timeout": "vllm_server_timeout_s",
    "vllm_importance_sampling_mode": "sampling_correction",
    "vllm_importance_sampling_clip_min": "sampling_correction_min",
    "vllm_importance_sampling_clip_max": "sampling_correction_max",
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split",
}

# TRL's names with no setting of the same meaning here, and what to use instead.
TRL_INSTEAD = {
    "per_device_train_batch_size": "batch_size, the completions of one step over every rank (TRL's "
    "per_device_train_batch_size x processes x gradient_accumulation_steps)",
    "gradient_accumulation_steps": "max_tokens_per_micro_batch or micro_batch_size: a step is one optimizer "
    "update over batch_size completions, accumulated over micro-batches that fit in memory",
    "generation_batch_size": "batch_size: each step samples batch_size completions",
    "steps_per_generation": "num_iterations, the optimisation passes over each rollout batch",
    "num_train_epochs": "steps",
    "use_vllm": "generator vllm",
    "vllm_server_base_url": "vllm_server_urls, one or more base URLs (http://host:8000)",
    "vllm_server_host": "vllm_server_urls, one or more base URLs (http://host:8000)",
    "vllm_server_port": "vllm_server_urls, one or more base URLs (http://host:8000)",
    "vllm_enable_sleep_mode": "vllm_sleep_level",
    "vllm_importance_sampling_correction": "sampling_correction (None turns it off)",
    "bf16": "precision bf16",
    "fp16": "precision bf16 (fp16 is not supported) or fp32",
    "logging_steps": "nothing: every step is logged (log_completions_every for completions)",
    "log_completions": "log_completions_every",
    "per_device_eval_batch_size": "eval_samples, the completions per eval prompt",
}


def from_trl_names(values: dict) -> dict:
    """``values`` with TRL's names of our settings renamed to ours (:data:`TRL_ALIASES`); a TRL
    name we have no setting for is a ValueError that says which of ours to use. TRL's
    ``max_completion_length`` limits generation and is dr_grpo's normaliser: given without
    ``max_new_tokens`` it sets both, as in TRL."""
    out = {}
    for key, value in values.items():
        if key in TRL_INSTEAD:
            raise ValueError(f"{key!r} is TRL's and has no equivalent here: use {TRL_INSTEAD[key]}")
        name = TRL_ALIASES.get(key, key)
        if name in out or (name != key and name in values):
            raise ValueError(f"{key!r} is TRL's name of {name!r}: give one of the two, not both")
        if key == "scale_rewards" and isinstance(value, bool):  # TRL's older boolean form
            value = "group" if value else "none"
        out[name] = value
    if out.get("max_completion_length") is not None and "max_new_tokens" not in out:
        out["max_new_tokens"] = out["max_completion_length"]
    return out
