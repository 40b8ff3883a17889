"""The per-token policy math of the production paths, on [B, T] or flat token tensors.

The CPU path of ``grpo_loss``, the fused LM head, and the two-pass CUDA path (sequence-level
ratios, loss types without a one-launch kernel) all run it after their own vocabulary
sweep; the Triton loss kernel reads the same prepared batch. A batch's tensors are prepared
once (:class:`PolicyBatch`: the aggregation's token weights from the loss spec, everything
in the accumulation dtype), and since with token-level ratios each token's loss term
depends on that token alone, the fused LM head evaluates it chunk by chunk on flat token
rows (:meth:`PolicyBatch.rows`).
"""

import dataclasses
from typing import NamedTuple

import torch

from grpo_fast.ops._validate import check_loss_batch
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import IMPORTANCE_LEVELS, LossConfig, loss_metrics, per_token_loss, without_padding


class LossInputs(NamedTuple):
    """A call's per-token inputs as the public ops take them (see :func:`grpo_fast.grpo_loss`)."""

    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    num_items_in_batch: torch.Tensor | float | None = None

    def check(self, B: int, T: int, config: LossConfig) -> "LossInputs":
        check_loss_batch(B, T, config, self)
        return self

    def run_reference(self, fn, *leading, config: LossConfig, **keywords):
        """``fn`` of ``grpo_fast.reference`` on ``leading`` (logits and ids, or log-probs) and
        these inputs (``GRPO_FAST_BACKEND=reference``)."""
        return fn(
            *leading,
            *self[:4],
            num_items_in_batch=self.num_items_in_batch,
            importance_weights=self.importance_weights,
            **keywords,
            **dataclasses.asdict(config),
        )


class PolicyBatch(NamedTuple):
    """A batch's per-token inputs in one float dtype: mask and weights [B, T]; adv and iw
    [B, 1] or [B, T]; old and ref [B, T]; iw, old and ref None when absent. weights is
    dL/dper_token, the loss type's aggregation (0 on padding); the per-token inputs are 0 on
    padding."""

    mask: torch.Tensor
    weights: torch.Tensor
    adv: torch.Tensor
    iw: torch.Tensor | None
    old: torch.Tensor | None
    ref: torch.Tensor | None

    @classmethod
    def prepare(cls, config: LossConfig, shape, dtype, device, inputs: LossInputs) -> "PolicyBatch":
        """From validated inputs on the [B, T] grid ``shape``, in ``dtype`` on ``device``."""

        def convert(x):
            if x is None:
                return None
            x = x.detach().to(device=device, dtype=dtype)
            return x.unsqueeze(1) if x.dim() == 1 else x

        m = torch.ones(shape, dtype=dtype, device=device) if inputs.mask is None else convert(inputs.mask)
        weights = config.aggregation.token_weights(m, config, inputs.num_items_in_batch)
        tensors = (inputs.advantages, inputs.importance_weights, inputs.old_logprobs, inputs.ref_logprobs)
        return cls(m, weights, *without_padding(m, *map(convert, tensors)))

    def flat(self) -> "PolicyBatch":
        """Every tensor as a contiguous [B * T] array (the Triton kernel's layout)."""
        shape = self.mask.shape
        return PolicyBatch(*(None if x is None else x.expand(shape).reshape(-1).contiguous() for x in self))

    def take(self, idx: torch.Tensor) -> "PolicyBatch":
        """Every tensor at the flat token positions ``idx`` [n], as [n] arrays."""
        shape = self.mask.shape
        return PolicyBatch(*(None if x is None else x.expand(shape).reshape(-1)[idx] for x in self))

    def rows(self, r: slice) -> "PolicyBatch":
        """Flat token rows ``r`` of every tensor (token-level ratios only: rows are independent)."""
        shape = self.mask.shape
        return PolicyBatch(*(None if x is None else x.expand(shape).reshape(-1)[r] for x in self))


def loss_terms(logp: torch.Tensor, batch: PolicyBatch, config: LossConfig):
    """``(weight * (pg * iw + beta * kl), kl, w)`` per token (kl None without reference
    log-probs; w [B, 1] for sequence-level ratios). Token-level ratios work on any shape,
    flat rows included."""
    (logp,) = without_padding(batch.mask, logp)
    old = logp.detach() if batch.old is None else batch.old
    w = torch.exp(IMPORTANCE_LEVELS[config.importance_sampling](logp - old, batch.mask))
    per_token, kl = per_token_loss(w, logp, batch.adv, batch.ref, batch.iw, config)
    return per_token * batch.weights, kl, w


def logp_grad(logp: torch.Tensor, batch: PolicyBatch, config: LossConfig) -> torch.Tensor:
    """dL/dlogp, the shape of ``logp``."""
    with torch.enable_grad():
        x = logp.detach().requires_grad_()
        (g,) = torch.autograd.grad(loss_terms(x, batch, config)[0].sum(), x)
    return g


def policy_loss(logp: torch.Tensor, batch: PolicyBatch, config: LossConfig, entropy=None) -> LossOutput:
    """The loss (differentiable in ``logp`` [B, T]) and its metrics."""
    terms, kl, w = loss_terms(logp, batch, config)
    return LossOutput(terms.sum(), **loss_metrics(w, batch.adv, kl, entropy, batch.mask, config))
