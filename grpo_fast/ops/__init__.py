"""The fused ops: one file per op, each dispatching to Triton (CUDA) or a chunked torch path."""

from grpo_fast.ops.fused_linear_grpo_loss import fused_linear_grpo_loss
from grpo_fast.ops.fused_linear_token_logprobs import fused_linear_token_logprobs
from grpo_fast.ops.group_advantages import group_advantages
from grpo_fast.ops.grpo_loss import grpo_loss
from grpo_fast.ops.policy_loss import policy_loss
from grpo_fast.ops.token_logprobs import token_logprobs

__all__ = [
    "group_advantages",
    "grpo_loss",
    "policy_loss",
    "token_logprobs",
    "fused_linear_grpo_loss",
    "fused_linear_token_logprobs",
]
