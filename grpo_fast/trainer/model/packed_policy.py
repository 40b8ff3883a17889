"""The policy's packed forward and its loss as one module: what DDP wraps and FSDP2 shards.

Every use of the weights in a training or log-prob pass happens inside
:meth:`PackedPolicy.forward`: the packed forward (``grpo_fast/packing/``), the LM head and, given
:class:`LossInputs`, the loss of the micro-batch. That is where the distributed wrappers act:
DDP arms its gradient reduction in the wrapper's forward, and FSDP2 gathers a unit's weights
around its forward only, so the fused LM-head loss, which reads the head's weight itself,
must run inside it (anywhere else that weight is one rank's shard).

Under sequence parallelism (``runtime.ranks.sequence_group``) each rank of a group runs the
forward and the LM head on its shard of the pack's tokens (``packing.sequence_shard``), and
the per-token log-probs (and entropies) are gathered into the whole pack's on every rank of the
group, which then computes the same loss as one rank would (``packing/sequence_parallel.py``).
"""

from typing import NamedTuple

import torch

from grpo_fast import fused_linear_token_logprobs, policy_loss, token_logprobs
from grpo_fast.base_model import base_model
from grpo_fast.ops.fused_linear_grpo_loss import fused_head_saves_memory, fused_linear_loss_with_tokens
from grpo_fast.ops.policy import LossInputs
from grpo_fast.outputs import LossOutput
from grpo_fast.packing import (
    Packed,
    Shard,
    check_heads,
    gather_tokens,
    pack,
    packed_hidden,
    packed_logits,
    sequence_shard,
    to_grid,
    use_packed_attention,
)
from grpo_fast.spec import LossConfig, SamplingCorrection, sampling_correction


def filler(device: torch.device) -> Packed:
    """A one-sequence micro-batch (one prompt token, one completion token, id 0): what a rank
    with fewer micro-batches than another runs, its loss times 0, so that both make the same
    collectives."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return pack(ids, torch.ones_like(ids), 1, slice(0, 1))


class Behaviour(NamedTuple):
    """What the sampling correction of a micro-batch compares with: the log-probs the samples
    were drawn with [n, C] and the completion mask [n, C] of its rows (0 on tool-result tokens,
    where the sampler reports log-prob 0: they get weight 0 and count in no sequence's ratio),
    and the run's options of :func:`~grpo_fast.spec.sampling_correction` (mode, clip_min,
    clip_max)."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    options: dict


class PassOutput(NamedTuple):
    """One micro-batch's loss pass: the loss output, the policy's log-probs of its completion
    tokens [Nc] (detached), and the sampling correction its loss applied (grids [n, C]), if any."""

    loss: LossOutput
    logprobs: torch.Tensor
    correction: SamplingCorrection | None


def corrected(inputs: LossInputs, logp: torch.Tensor, packed: Packed, behaviour: Behaviour) -> tuple:
    """``(inputs with the correction's importance weights [Nc], the correction)`` of a
    micro-batch whose policy log-probs [Nc] are ``logp`` (the correction on its [n, C] grid)."""
    grid = to_grid(logp.unsqueeze(0), packed)
    correction = sampling_correction(grid, behaviour.logprobs, behaviour.mask, **behaviour.options)
    return inputs._replace(importance_weights=correction.weights[packed.grid]), correction


class PackedPolicy(torch.nn.Module):
    """``policy`` (a causal LM) run on packed micro-batches.

    Args:
        policy: the model; its parameters are this module's. Its attention is set to the packed
            attention here, once (``use_packed_attention``): every packed pass of the trainer,
            the policy's, the reference's and a rollout worker's, runs through this module.
        loss_config: the run's loss options (its temperature scales every log-prob).
        runtime: the precision of the forwards (``Runtime.autocast``).
        entropy: the loss passes also average the per-token entropy (a logged number: on
            CPU it costs three of a chunk's five vocabulary passes).
    """

    def __init__(self, policy, loss_config: LossConfig, runtime, *, entropy: bool = True):
        super().__init__()
        self.policy = use_packed_attention(policy)
        self.loss_config, self.runtime, self.entropy = loss_config, runtime, entropy
        if runtime.ranks.sequence_parallel > 1:  # refused before the first rollout, not at the first pass
            base = base_model(policy)
            text = base.config.get_text_config()
            heads = text.num_attention_heads
            check_heads(runtime.ranks.sequence_parallel, heads, getattr(text, "num_key_value_heads", None) or heads)

    def forward(
        self,
        packed: Packed,
        inputs: LossInputs | None = None,
        *,
        fused_linear: bool = False,
        behaviour: Behaviour | None = None,
    ):
        """Without ``inputs``: the completion tokens' log-probs [n, C] (0 where a row has no
        token), differentiable when gradients are enabled.

        With ``inputs`` (the micro-batch's flat per-token inputs [Nc], sequence boundaries
        ``packed.completion_cu_seqlens``): a :class:`PassOutput`, the loss being
        ``policy_loss`` of the packed log-probs, or with ``fused_linear`` the loss from the
        last hidden states [Nc, H] and the LM head (``fused_linear_grpo_loss``, never the
        [Nc, V] logits) where it saves memory (``fused_head_saves_memory``: not where the
        logits fit one of its chunks). No padded grid either way.

        ``behaviour`` (with ``inputs``): the loss applies the sampling correction of these
        log-probs against the micro-batch's own as ``importance_weights``. The weights are the
        policy's as the step starts, so its log-probs are the correction's proximal ones: no
        other pass over the model computes them (the fused LM head sweeps the vocabulary once
        more for them, without gradients). The correction comes back in the output.
        """
        config, correction = self.loss_config, None
        head = self.policy.get_output_embeddings()
        fused_linear = fused_linear and fused_head_saves_memory(packed.targets.numel(), head.weight, self.runtime.dtype)
        group = self.runtime.ranks.sequence_group
        if group is not None:
            shard = sequence_shard(packed, group)
            logp, entropy = self._shard_logprobs(packed, shard, inputs is not None and fused_linear, inputs is not None)
            if inputs is None:
                return to_grid(logp.unsqueeze(0), packed)
            return self._loss(packed, inputs, logp, entropy, behaviour)
        with self.runtime.autocast():
            if inputs is not None and fused_linear:
                hidden = packed_hidden(self.policy, packed)
                if behaviour is not None:
                    with torch.no_grad():
                        logp = fused_linear_token_logprobs(
                            hidden, head.weight, packed.targets[0], bias=head.bias, temperature=config.temperature
                        )
                    inputs, correction = corrected(inputs, logp, packed, behaviour)
                out, tokens = fused_linear_loss_with_tokens(
                    hidden,
                    head.weight,
                    head.bias,
                    packed.targets[0],
                    inputs,
                    config,
                    return_entropy=self.entropy,
                )
                return PassOutput(out, tokens.logp, correction)
            logits = packed_logits(self.policy, packed)  # [1, Nc, V]
        if inputs is None:
            return to_grid(token_logprobs(logits, packed.targets, temperature=config.temperature), packed)
        logp = token_logprobs(logits, packed.targets, temperature=config.temperature, return_entropy=self.entropy)
        logp, entropy = (x[0] for x in logp) if self.entropy else (logp[0], None)
        return self._loss(packed, inputs, logp, entropy, behaviour)

    def _shard_logprobs(self, packed: Packed, shard: Shard, fused_linear: bool, loss: bool) -> tuple:
        """``(log-probs [Nc], entropies [Nc] or None)`` of the whole pack, from this rank's
        ``shard``: its forward, its tokens' LM head (with ``fused_linear`` from the hidden states,
        never their logits), gathered over the sequence group. Entropies for a ``loss`` pass
        that logs them."""
        temperature, entropy = self.loss_config.temperature, loss and self.entropy
        head = self.policy.get_output_embeddings()
        targets = packed.targets[:, shard.tokens]  # [1, n]
        with self.runtime.autocast():
            if fused_linear:
                hidden = packed_hidden(self.policy, packed, shard)
                out = fused_linear_token_logprobs(
                    hidden, head.weight, targets[0], bias=head.bias, temperature=temperature, return_entropy=entropy
                )
            else:
                logits = packed_logits(self.policy, packed, shard)  # [1, n, V]
        if not fused_linear:
            out = token_logprobs(logits, targets, temperature=temperature, return_entropy=entropy)
            out = tuple(x[0] for x in out) if entropy else out[0]
        logp, entropies = out if entropy else (out, None)
        return gather_tokens(logp, shard), None if entropies is None else gather_tokens(entropies, shard)

    def _loss(self, packed: Packed, inputs: LossInputs, logp, entropy, behaviour: Behaviour | None) -> PassOutput:
        """The :class:`PassOutput` of ``policy_loss`` on the pack's log-probs ``logp`` [Nc] (and
        ``entropy`` [Nc] or None), the sampling correction of ``behaviour`` applied."""
        config, correction = self.loss_config, None
        if behaviour is not None:
            inputs, correction = corrected(inputs, logp.detach(), packed, behaviour)
        out = policy_loss(
            logp,
            inputs.advantages,
            inputs.mask,
            inputs.old_logprobs,
            inputs.ref_logprobs,
            num_items_in_batch=inputs.num_items_in_batch,
            importance_weights=inputs.importance_weights,
            entropy=entropy,
            cu_seqlens=inputs.cu_seqlens,
            loss_config=config,
        )
        return PassOutput(out, logp.detach(), correction)
