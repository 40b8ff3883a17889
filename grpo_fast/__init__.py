"""grpo_fast: fast, lean GRPO. Fused ops for group advantages, token log-probs and the loss."""

from grpo_fast.ops import (
    fused_linear_grpo_loss,
    fused_linear_token_logprobs,
    group_advantages,
    grpo_loss,
    policy_loss,
    token_logprobs,
)
from grpo_fast.outputs import GroupAdvantages, LossOutput
from grpo_fast.spec import LossConfig

__version__ = "0.1.0"
__all__ = [
    "group_advantages",
    "token_logprobs",
    "grpo_loss",
    "policy_loss",
    "fused_linear_grpo_loss",
    "fused_linear_token_logprobs",
    "GroupAdvantages",
    "LossOutput",
    "LossConfig",
    "__version__",
]
