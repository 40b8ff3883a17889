"""GRPOConfig: every knob of a run, from defaults, a YAML file and command-line overrides.

The defaults are the built-in demo (``grpo-fast train`` with no arguments): a tiny model
learning single-digit addition on a CPU in well under three minutes.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from grpo_fast.reference import IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_TYPES, SCALES

LR_SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class GRPOConfig:
    """A GRPO run. ``batch_size`` counts completions: ``batch_size // group_size`` prompts per step."""

    # what to train, on what
    model: Optional[str] = None  # local path for from_pretrained; None = the built-in tiny model
    dataset: Optional[str] = None  # JSONL / CSV / datasets.save_to_disk folder; None = the arithmetic demo
    prompt_column: str = "prompt"
    answer_column: Optional[str] = None
    system_prompt: Optional[str] = None
    reward_funcs: Optional[list] = None  # names in grpo_fast.rewards or "module:function"; None = task default
    reward_weights: Optional[list] = None  # one per reward function; None = all 1
    output_dir: Optional[str] = None  # None = runs/<time>
    seed: int = 0

    # rollout
    steps: int = 300
    batch_size: int = 128  # completions per step
    group_size: int = 16  # G, completions per prompt
    max_prompt_length: Optional[int] = None  # longer prompts keep their last tokens
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0

    # loss (grpo_fast.grpo_loss options)
    loss_type: str = "grpo"
    beta: float = 0.005
    kl_estimator: str = "k3"
    eps_low: float = 0.2
    eps_high: Optional[float] = None
    delta: Optional[float] = None
    importance_sampling: str = "token"
    advantage_scale: str = "group"
    num_iterations: int = 1  # mu: optimisation passes over each rollout batch

    # optimisation
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 5
    lr_schedule: str = "constant"
    max_grad_norm: Optional[float] = 1.0
    micro_batch_size: Optional[int] = None  # sequences per forward/backward; None = the whole batch

    # memory and speed
    precision: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False
    fused_linear: bool = False  # the loss from hidden states (fused_linear_grpo_loss) when available
    lora_r: int = 0  # > 0 wraps the policy in a peft LoRA; the reference is the same model, adapters off
    lora_alpha: int = 16
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    device: str = "auto"  # auto = cuda when available, else cpu

    # bookkeeping
    save_every: int = 50  # checkpoint every k steps (and always at the end); 0 = only at the end
    keep_checkpoints: int = 2
    progress: bool = True

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size

    @classmethod
    def from_dict(cls, values: dict) -> "GRPOConfig":
        """Builds and validates a config; unknown keys are a ValueError that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys are {sorted(known)}")
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "GRPOConfig":
        """Reads a YAML mapping of config keys, then applies ``overrides`` (None values are skipped)."""
        import yaml

        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of keys to values, got {type(values).__name__}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raises ValueError naming the first inconsistent setting."""

        def require(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        def choice(name: str, options):
            value = getattr(self, name)
            require(value in options, f"{name} must be one of {tuple(options)}, got {value!r}")

        for name in ("steps", "batch_size", "max_new_tokens", "num_iterations"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
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
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature!r}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        require(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate!r}")
        require(self.beta >= 0, f"beta must be >= 0, got {self.beta!r}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        require(self.save_every >= 0, f"save_every must be >= 0, got {self.save_every!r}")
        require(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints!r}")
        require(self.lora_r >= 0, f"lora_r must be >= 0, got {self.lora_r!r}")
        choice("loss_type", LOSS_TYPES)
        choice("kl_estimator", KL_ESTIMATORS)
        choice("importance_sampling", IMPORTANCE_LEVELS)
        choice("advantage_scale", SCALES)
        choice("lr_schedule", LR_SCHEDULES)
        choice("precision", PRECISIONS)
        if self.reward_weights is not None:
            require(
                self.reward_funcs is not None and len(self.reward_weights) == len(self.reward_funcs),
                f"reward_weights needs one weight per entry of reward_funcs, got {self.reward_weights!r} "
                f"for {self.reward_funcs!r}",
            )
        if self.model is not None:
            require(os.path.isdir(self.model), f"model path {self.model!r} is not a directory (nothing is downloaded)")
        if self.dataset is not None:
            require(os.path.exists(self.dataset), f"dataset path {self.dataset!r} does not exist")
