"""policy_loss: the GRPO loss from per-token log-probs that the caller already has.

For callers whose log-probs come from elsewhere: packed (padding-free) forwards scattered
back to a [B, T] grid, a framework's own log-prob path (verl's policy-loss functions take
log-probs), or a model with a custom head. The work is O(B * T): no vocabulary sweep, one
path for every device (``ops/_policy.py``, what ``grpo_loss`` runs after its sweep).
"""

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._policy import LossInputs, PolicyBatch
from grpo_fast.ops._policy import policy_loss as _policy_loss
from grpo_fast.ops._validate import check_tensor, loss_options
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import LossConfig, accumulate_dtype


@loss_options
def policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    num_items_in_batch=None,
    importance_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    loss_config: LossConfig | None = None,
) -> LossOutput:
    """The GRPO policy loss of :func:`grpo_fast.grpo_loss` from log-probs [B, T].

    Args:
        logprobs: [B, T] log-probs of the completion tokens under the policy being trained
            (at the loss's temperature), differentiable; float32 or float64 (16-bit inputs
            are computed in float32).
        advantages, mask, old_logprobs, ref_logprobs, num_items_in_batch, importance_weights,
        loss_config: as in :func:`grpo_fast.grpo_loss`.
        entropy: [B, T] per-token entropy, only averaged into ``LossOutput.entropy``.
        {loss_options}

    Returns:
        :class:`LossOutput`; ``loss`` is differentiable with respect to ``logprobs``.

    Example:
        >>> logp = token_logprobs(packed_logits, packed_ids)[0, index]  # [B, T] from a packed row
        >>> out = policy_loss(logp, advantages, mask, old_logp, ref_logp, beta=0.04)
    """
    config = loss_config
    check_tensor("logprobs", logprobs, 2)
    B, T = logprobs.shape
    inputs = LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch)
    inputs.check(B, T, config)
    if entropy is not None and tuple(entropy.shape) != (B, T):
        raise ValueError(f"entropy must have shape [B, T] = {[B, T]}, got {list(entropy.shape)}")
    if select_backend(logprobs) == "reference":
        return inputs.run_reference(reference.policy_loss, logprobs, config=config, entropy=entropy)
    acc = accumulate_dtype(logprobs)
    batch = PolicyBatch.prepare(config, (B, T), acc, logprobs.device, inputs)
    return _policy_loss(logprobs.to(acc), batch, config, None if entropy is None else entropy.to(acc))
