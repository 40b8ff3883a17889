"""The lean GRPO trainer: config, rollout (shared with the PPO baseline), loop, checkpoints."""

from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.grpo import GRPOTrainer
from grpo_fast.trainer.rollout import RewardError, Rollout

__all__ = ["GRPOConfig", "GRPOTrainer", "Rollout", "RewardError"]
