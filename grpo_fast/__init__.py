"""grpo_fast: fast, lean GRPO. Fused ops for group advantages, token log-probs and the loss."""

from typing import TYPE_CHECKING

from grpo_fast._lazy import lazy_exports

if TYPE_CHECKING:
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

# Imported on first use: ``import grpo_fast.cli`` parses a command line without loading torch.
__getattr__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            [
                "group_advantages",
                "token_logprobs",
                "grpo_loss",
                "policy_loss",
                "fused_linear_grpo_loss",
                "fused_linear_token_logprobs",
            ],
            "grpo_fast.ops",
        ),
        "GroupAdvantages": "grpo_fast.outputs",
        "LossOutput": "grpo_fast.outputs",
        "LossConfig": "grpo_fast.spec",
    },
)

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
