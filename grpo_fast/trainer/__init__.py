"""The lean GRPO trainer: config, rollout sources, the step's stages, the run loop, checkpoints."""

from typing import TYPE_CHECKING

from grpo_fast._lazy import lazy_exports

if TYPE_CHECKING:
    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.grpo import GRPOTrainer
    from grpo_fast.trainer.rollout.samples import RewardError, Samples
    from grpo_fast.trainer.update.batch import StepBatch

# Imported on first use: the config (and the command line) load without torch.
__getattr__ = lazy_exports(
    __name__,
    {
        "GRPOConfig": "grpo_fast.trainer.config",
        "GRPOTrainer": "grpo_fast.trainer.grpo",
        "Samples": "grpo_fast.trainer.rollout.samples",
        "RewardError": "grpo_fast.trainer.rollout.samples",
        "StepBatch": "grpo_fast.trainer.update.batch",
    },
)

__all__ = ["GRPOConfig", "GRPOTrainer", "Samples", "StepBatch", "RewardError"]
