"""Ulysses sequence parallelism: one packed row's tokens spread over the ranks of a group.

A long packed row (``layout.py``) holds S tokens; its activations, layer after layer, grow with
S. Under sequence parallelism of degree N each rank of a group runs the model on 1/N of the
row's tokens: a contiguous shard of T = ceil(S / N) positions (:func:`sequence_shard`; the last
ranks' tail padded with token 0 at position 0, which nothing reads). Every layer but attention works
token by token, so it runs on the shard as it would on the whole row; rotary embeddings take
each token's own position, which a packed row carries (restarting at each sequence).

Attention needs every key of a sequence, so it swaps what a rank holds (DeepSpeed-Ulysses,
Jacobs et al. 2023): an all-to-all turns the shard's queries, keys and values [1, H, T, d],
all heads of T tokens, into [1, H/N, N*T, d], H/N heads of every token; the pack's own
attention (``attention.packed_sdpa``: whole rows, shared prefixes, FlexAttention) runs there on
the whole row as on one rank, since every rank knows the whole layout; a second all-to-all
swaps back. Four exchanges a layer (q, k and v in, the output back), each moving about 1/N of
that tensor per rank, instead of a gather of every key: a rank's traffic falls as N grows. The
price: the heads must divide by N (grouped-query key/value heads that do not are repeated to
the query heads first, which costs more communication but is exact).

The LM head runs, on each rank, at its shard's positions that predict a completion token
(:attr:`Shard.logit_index`; a shared prefix's last prompt token predicts each of its group's
first completion tokens, wherever they lie). The per-token results are small ([Nc] log-probs),
so :func:`gather_tokens` sums them into the whole pack's on every rank, and every rank then
computes the same loss as one rank would, with the same normalizers: no loss code changes
(summing each normalizer over the group instead would touch every loss type's aggregation).
Its backward hands each rank the gradient of its own tokens (the identity, not a second sum:
every rank holds the whole loss), so a parameter's gradient on a rank is its tokens' share,
and the sum over the group's ranks, which DDP or FSDP2 take with the data-parallel ranks' in
their one average over the world, is the whole row's.
"""

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from grpo_fast.packing.layout import Packed


class Shard(NamedTuple):
    """This rank's share of a pack under sequence parallelism (:func:`sequence_shard`).

    ``group`` the ranks that share the row, ``length`` T the tokens per rank (the pack's S real
    tokens are ``total``), ``start`` this rank's first packed position. ``input_ids`` and
    ``position_ids`` [1, T] its tokens (padding: id 0, position 0). ``logit_index`` [n] the
    shard's positions whose logits predict a completion token, ``tokens`` [n] those tokens'
    indices among the pack's ``completions`` (Nc)."""

    group: dist.ProcessGroup
    start: int
    length: int
    total: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    tokens: torch.Tensor
    completions: int


def sequence_shard(packed: Packed, group: dist.ProcessGroup) -> Shard:
    """This rank's :class:`Shard` of ``packed`` in ``group``: contiguous positions
    ``[rank * T, (rank + 1) * T)`` of the S packed tokens, T = ceil(S / N), N = the group's size.
    Every rank of the group packs the same rows, so the layout (``packed.grids``, its block
    mask) is whole on each, and only the tokens are split."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    total = packed.input_ids.shape[1]
    length = max(1, math.ceil(total / size))
    start = rank * length

    def tokens(x):  # [1, S] -> this rank's [1, T], padded with 0 (a row shorter than N: whole shards)
        part = x[:, start : start + length]
        return torch.nn.functional.pad(part, (0, length - part.shape[1]))

    ours = (packed.logit_index >= start) & (packed.logit_index < start + length)
    index = torch.nonzero(ours).squeeze(1)  # a read to the host: the count sizes the LM head's rows
    return Shard(
        group=group,
        start=start,
        length=length,
        total=total,
        input_ids=tokens(packed.input_ids),
        position_ids=tokens(packed.position_ids),
        logit_index=packed.logit_index[index] - start,
        tokens=index,
        completions=packed.logit_index.shape[0],
    )


class _AllToAll(torch.autograd.Function):
    """:func:`ulysses_all_to_all` with its backward: the inverse all-to-all of the gradient (the
    forward only moves values, so its transpose moves them back)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Splits ``x`` in N chunks along ``scatter_dim``, sends chunk j to rank j, and concatenates
    the chunks received, in rank order, along ``gather_dim``."""
    size = dist.get_world_size(group)
    sent = torch.stack(x.chunk(size, scatter_dim)).contiguous()  # [N, ...]: chunk j goes to rank j
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), gather_dim)


def ulysses_all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """The Ulysses swap, differentiable: ``x`` split in N = the group's size chunks along
    ``scatter_dim`` (its size divisible by N), chunk j sent to rank j, the chunks received
    concatenated in rank order along ``gather_dim``. [1, H, T, d] with ``(1, 2)`` gives
    [1, H/N, N*T, d] (heads for tokens); ``(2, 1)`` the inverse."""
    if x.shape[scatter_dim] % dist.get_world_size(group):
        raise ValueError(
            f"ulysses_all_to_all: x's dimension {scatter_dim} (size {x.shape[scatter_dim]}) must divide by the "
            f"group's {dist.get_world_size(group)} ranks"
        )
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def check_heads(size: int, heads: int, kv_heads: int) -> None:
    """ValueError unless ``size`` (the sequence-parallel degree) divides the ``heads`` query
    heads, which the all-to-all splits over the group (``kv_heads`` named in the message; they
    need not divide, see :func:`ulysses_attention`)."""
    if heads % size:
        raise ValueError(
            f"sequence_parallel={size} must divide the model's attention heads: it has {heads} query heads and "
            f"{kv_heads} key/value heads"
        )


def ulysses_attention(attend, shard: Shard, module, query, key, value, attention_mask, *args, **kwargs):
    """``attend`` (a transformers attention function of the whole pack, such as
    ``packed_sdpa``) run on this rank's :class:`Shard`: query [1, H, T, d], key and value
    [1, kv_heads, T, d] of the shard's tokens, swapped to H/N heads of all S tokens, attended,
    swapped back. Returns ([1, T, H, d], None), as ``attend`` would for the shard's tokens.
    Raises ValueError when the heads do not divide by the group's size N (``sequence_parallel``)."""
    size, heads, kv_heads = dist.get_world_size(shard.group), query.shape[1], key.shape[1]
    check_heads(size, heads, kv_heads)
    if kv_heads % size:  # grouped-query heads a rank cannot split: each query head gets its own copy
        key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
    # [1, h, T, d] -> [1, h/N, N*T, d] -> the real S tokens (the last shard's padding dropped)
    query, key, value = (ulysses_all_to_all(x, shard.group, 1, 2)[:, :, : shard.total] for x in (query, key, value))
    out, _ = attend(module, query, key, value, attention_mask, *args, **kwargs)  # [1, S, H/N, d]
    out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, size * shard.length - shard.total))
    return ulysses_all_to_all(out, shard.group, 1, 2), None  # [1, T, H, d]


class _SumReplicated(torch.autograd.Function):
    """The sum over a group of tensors that every rank then uses alike: the backward passes
    each rank's gradient through unchanged (each holds the whole downstream result, so its
    gradient is already the whole one; a second sum would count it N times)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_tokens(values: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Per-completion-token values of this rank's shard, [n] or [n, ...] in the order of
    ``shard.tokens``, as the whole pack's [Nc] or [Nc, ...] on every rank of the group,
    differentiable (each rank's gradient flows to its own tokens only; see the module
    docstring)."""
    whole = values.new_zeros((shard.completions, *values.shape[1:])).index_put((shard.tokens,), values)
    return _SumReplicated.apply(whole, shard.group)
