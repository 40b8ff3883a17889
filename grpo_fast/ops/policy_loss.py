"""policy_loss: the GRPO loss from per-token log-probs that the caller already has.

For callers whose log-probs come from elsewhere: a packed (padding-free) forward, whose
tokens arrive as flat rows [Nc] with sequence boundaries ``cu_seqlens``, a framework's own
log-prob path (verl's policy-loss functions take log-probs), or a model with a custom head.
The work is O(tokens): no vocabulary sweep, one path for every device (``ops/policy.py``,
what ``grpo_loss`` runs after its sweep).
"""

import torch

from grpo_fast import reference
from grpo_fast.ops._backend import select_backend
from grpo_fast.ops._validate import check_cu_seqlens, check_tensor, loss_options
from grpo_fast.ops.policy import LossInputs, PolicyBatch
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
    cu_seqlens: torch.Tensor | None = None,
    loss_config: LossConfig | None = None,
) -> LossOutput:
    """The GRPO policy loss of :func:`grpo_fast.grpo_loss` from log-probs [B, T], or from
    flat token rows [Nc] of packed sequences.

    Args:
        logprobs: [B, T] log-probs of the completion tokens under the policy being trained
            (at the loss's temperature), differentiable; float32 or float64 (16-bit inputs
            are computed in float32). With ``cu_seqlens``: [Nc], the sequences' tokens back to back.
        advantages, mask, old_logprobs, ref_logprobs, num_items_in_batch, importance_weights,
        loss_config: as in :func:`grpo_fast.grpo_loss`; with ``cu_seqlens`` the per-token
            tensors are [Nc], and advantages and importance weights [Nc] or [n, 1] per sequence.
        entropy: per-token entropy (the shape of ``logprobs``), only averaged into ``LossOutput.entropy``.
        cu_seqlens: [n + 1] integer sequence boundaries of flat ``logprobs`` (flash-attention's
            varlen layout: sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1;
            empty sequences count as rows of the aggregation), or None for a [B, T] grid.
        {loss_options}

    Returns:
        :class:`LossOutput`; ``loss`` is differentiable with respect to ``logprobs``.

    Example:
        >>> logp = token_logprobs(packed_logits, packed_ids)[0]  # [Nc] from a packed forward
        >>> out = policy_loss(logp, advantages, mask, old_logp, ref_logp, cu_seqlens=cu, beta=0.04)
    """
    config = loss_config
    check_tensor("logprobs", logprobs, 2 if cu_seqlens is None else 1)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, logprobs.shape[0], logprobs.device)
    inputs = LossInputs(
        advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch, cu_seqlens
    )
    inputs.check(logprobs.shape, config)
    if entropy is not None and entropy.shape != logprobs.shape:
        shape = "[B, T]" if cu_seqlens is None else "[Nc]"
        raise ValueError(f"entropy must have shape {shape} = {list(logprobs.shape)}, got {list(entropy.shape)}")
    backend = select_backend(logprobs)
    if backend == "reference" and cu_seqlens is None:
        return inputs.run_reference(reference.policy_loss, logprobs, config=config, entropy=entropy)
    acc = accumulate_dtype(logprobs)
    batch = PolicyBatch.prepare(config, logprobs.shape, acc, logprobs.device, inputs)
    return batch.loss(logprobs.to(acc).reshape(-1), config, None if entropy is None else entropy.to(acc).reshape(-1))
