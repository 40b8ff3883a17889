"""The per-token policy math of every production path, on flat token rows: the internal API.

The ops (``grpo_loss``'s CPU and two-pass CUDA paths, ``policy_loss``, the fused LM head),
the trainer and the integrations import these names. A call's per-token inputs arrive as
:class:`LossInputs`, either on a [B, T] grid or as flat token rows [Nc] with sequence
boundaries (``cu_seqlens``, the layout of a packed forward), and are prepared once into a
:class:`PolicyBatch`: flat [Nc] tensors in the accumulation dtype, the aggregation's token
weights from the loss spec, and :class:`Sequences`, which token belongs to which sequence. A
grid [B, T] is the flat layout of B sequences of T tokens (padding masked), so one
implementation serves both. With token-level ratios each token's loss term depends on that
token alone, so a token subset (:meth:`PolicyBatch.take`) is evaluated on its own: the fused
LM head does it chunk by chunk.

:meth:`PolicyBatch.evaluate` runs the math once per token and gives everything the callers
read: the weighted loss terms, dL/dlogp when asked, and the per-token ratio and KL from which
:meth:`PolicyBatch.metrics` forms the logged means without recomputing anything.
"""

import dataclasses
from typing import NamedTuple

import torch

from grpo_fast.ops._validate import check_loss_batch
from grpo_fast.outputs import LossOutput
from grpo_fast.spec import IMPORTANCE_LEVELS, LossConfig, per_token_loss, without_padding


class Sequences(NamedTuple):
    """Which sequence each flat token belongs to: ``index`` [Nc] (int64) of ``count`` sequences."""

    index: torch.Tensor
    count: int

    @classmethod
    def grid(cls, B: int, T: int, device) -> "Sequences":
        """Row b of a [B, T] grid flattened: tokens b * T .. b * T + T - 1."""
        return cls(torch.arange(B, device=device).repeat_interleave(T, output_size=B * T), B)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, num_tokens: int) -> "Sequences":
        """Sequences back to back: sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1."""
        tokens = torch.arange(num_tokens, device=cu_seqlens.device)
        return cls(torch.searchsorted(cu_seqlens[1:].contiguous().long(), tokens, right=True), len(cu_seqlens) - 1)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values [Nc] summed per sequence: [count]."""
        return x.new_zeros(self.count).index_add_(0, self.index, x)

    def take(self, rows) -> "Sequences":
        return Sequences(self.index[rows], self.count)


class LossInputs(NamedTuple):
    """A call's per-token inputs as the public ops take them (see :func:`grpo_fast.grpo_loss`):
    on a [B, T] grid (advantages and importance weights [B] or [B, T]), or flat token rows [Nc]
    when ``cu_seqlens`` [n + 1] is given (advantages and importance weights [n, 1] per sequence
    or [Nc] per token)."""

    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    num_items_in_batch: torch.Tensor | float | None = None
    cu_seqlens: torch.Tensor | None = None

    def check(self, shape, config: LossConfig) -> "LossInputs":
        """Checks against the token shape: [B, T], or [Nc] with ``cu_seqlens``."""
        check_loss_batch(shape, config, self)
        return self

    def run_reference(self, fn, *leading, config: LossConfig, **keywords):
        """``fn`` of ``grpo_fast.reference`` on ``leading`` (logits and ids, or log-probs) and
        these grid inputs (``GRPO_FAST_BACKEND=reference``)."""
        return fn(
            *leading,
            *self[:4],
            num_items_in_batch=self.num_items_in_batch,
            importance_weights=self.importance_weights,
            **keywords,
            **dataclasses.asdict(config),
        )


class Evaluation(NamedTuple):
    """One evaluation of the policy math on a batch's tokens (:meth:`PolicyBatch.evaluate`).

    terms [Nc]: weight * (pg * iw + beta * kl), 0 on padding; its sum is the tokens' share of
    the loss, differentiable in logp when the evaluation was. grad [Nc]: dL/dlogp, or None.
    w [Nc]: the importance ratio per token (a sequence's own at sequence level); w_seq [n] or
    None: the sequence-level ratios; kl [Nc] or None; all detached but ``terms``.
    """

    terms: torch.Tensor
    grad: torch.Tensor | None
    w: torch.Tensor
    w_seq: torch.Tensor | None
    kl: torch.Tensor | None


class PolicyBatch(NamedTuple):
    """A batch's per-token inputs as flat [Nc] tensors in one float dtype: mask, weights (the
    loss type's aggregation dL/dper_token, 0 on padding), adv, iw, old and ref (iw, old, ref
    None when absent; the per-token inputs 0 on padding); ``seqs`` the tokens' sequences and
    ``seq_adv`` [n] the advantages when they were given per sequence (the clip metrics of
    sequence-level ratios are then per sequence), else None."""

    mask: torch.Tensor
    weights: torch.Tensor
    adv: torch.Tensor
    iw: torch.Tensor | None
    old: torch.Tensor | None
    ref: torch.Tensor | None
    seqs: Sequences
    seq_adv: torch.Tensor | None

    @classmethod
    def prepare(cls, config: LossConfig, shape, dtype, device, inputs: LossInputs) -> "PolicyBatch":
        """From validated inputs of token shape ``shape`` ([B, T], or [Nc] with cu_seqlens),
        in ``dtype`` on ``device``."""
        if inputs.cu_seqlens is None:
            B, T = shape
            seqs = Sequences.grid(B, T, device)
        else:
            seqs = Sequences.packed(inputs.cu_seqlens.to(device), shape[0])
        N = seqs.index.shape[0]

        def convert(x):
            return None if x is None else x.detach().to(device=device, dtype=dtype)

        def per_token(x):  # per sequence ([B] on a grid, [n, 1] flat) or per token, -> [Nc]
            if x is None:
                return None
            x = convert(x)
            per_sequence = x.dim() == 1 if inputs.cu_seqlens is None else x.dim() == 2
            return x.reshape(-1).index_select(0, seqs.index) if per_sequence else x.reshape(N)

        m = torch.ones(N, dtype=dtype, device=device) if inputs.mask is None else convert(inputs.mask).reshape(N)
        row_len = seqs.sum(m).index_select(0, seqs.index)
        weights = config.aggregation.token_weights(m, row_len, seqs.count, config, inputs.num_items_in_batch)
        adv = inputs.advantages
        per_sequence_adv = adv.dim() == (1 if inputs.cu_seqlens is None else 2)
        seq_adv = convert(adv).reshape(-1) if per_sequence_adv else None
        tensors = (per_token(adv), per_token(inputs.importance_weights))
        old, ref = (None if x is None else convert(x).reshape(N) for x in (inputs.old_logprobs, inputs.ref_logprobs))
        return cls(m, weights, *without_padding(m, *tensors, old, ref), seqs, seq_adv)

    def take(self, rows) -> "PolicyBatch":
        """The tokens ``rows`` (a slice or an index tensor) of every per-token tensor."""
        return PolicyBatch(*(None if x is None else x[rows] for x in self[:6]), self.seqs.take(rows), self.seq_adv)

    def evaluate(self, logp: torch.Tensor, config: LossConfig, *, grad: bool = False) -> Evaluation:
        """The policy math on these tokens' log-probs ``logp`` [Nc], once. ``grad``: also
        dL/dlogp (``logp`` itself is then not differentiated). Token-level ratios work on any
        token subset (:meth:`take`); sequence-level ones need every token of a sequence."""
        if grad:
            with torch.enable_grad():
                x = logp.detach().requires_grad_()
                out = self.evaluate(x, config)
                (g,) = torch.autograd.grad(out.terms.sum(), x)
            return out._replace(terms=out.terms.detach(), grad=g)
        (logp,) = without_padding(self.mask, logp)
        old = logp.detach() if self.old is None else self.old
        log_w = IMPORTANCE_LEVELS[config.importance_sampling](logp - old, self.mask, self.seqs.sum)
        w_seq = None
        if config.importance_sampling == "sequence":  # log_w is [n]: one ratio per sequence
            w_seq = torch.exp(log_w)
            w = w_seq.index_select(0, self.seqs.index)
        else:
            w = torch.exp(log_w)
        per_token, kl = per_token_loss(w, logp, self.adv, self.ref, self.iw, config)
        return Evaluation(per_token * self.weights, None, w.detach(), None if w_seq is None else w_seq.detach(), kl)

    @torch.no_grad()
    def metrics(self, ev: Evaluation, config: LossConfig, entropy: torch.Tensor | None = None) -> dict:
        """The logged metrics of an evaluation (TRL's definitions, ``spec.loss_metrics``): 0-dim
        float32 means over active tokens; with sequence-level ratios the ratio's mean is over
        sequences, and so are the clip flags when the advantages were given per sequence."""
        m = self.mask
        n_active = m.sum().clamp(min=1.0)

        def token_mean(x):
            return ((x * m).sum() / n_active).float()

        kl = None if ev.kl is None else token_mean(ev.kl.detach())
        if ev.w_seq is not None and self.seq_adv is not None:
            low, high = config.kind.clip_flags(ev.w_seq, self.seq_adv, config)
            mean = lambda x: x.to(m.dtype).mean().float()  # noqa: E731
        else:
            low, high = config.kind.clip_flags(ev.w, self.adv, config)
            mean = lambda x: token_mean(x.to(m.dtype))  # noqa: E731
        return dict(
            kl=kl,
            clip_ratio_low=mean(low),
            clip_ratio_high=mean(high),
            clip_ratio_region=mean(low | high),
            ratio_mean=token_mean(ev.w) if ev.w_seq is None else ev.w_seq.mean().float(),
            entropy=None if entropy is None else token_mean(entropy.to(m.dtype)),
        )

    def loss(self, logp: torch.Tensor, config: LossConfig, entropy: torch.Tensor | None = None) -> LossOutput:
        """The loss (differentiable in ``logp`` [Nc]) and its metrics."""
        ev = self.evaluate(logp, config)
        return LossOutput(ev.terms.sum(), **self.metrics(ev, config, entropy))
