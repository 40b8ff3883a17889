"""The lean GRPO trainer: config, rollout sources, the step's stages, the run loop, checkpoints."""

from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.grpo import GRPOTrainer
from grpo_fast.trainer.rollout import RewardError, Samples
from grpo_fast.trainer.step import StepBatch

__all__ = ["GRPOConfig", "GRPOTrainer", "Samples", "StepBatch", "RewardError"]
