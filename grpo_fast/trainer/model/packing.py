"""Padding-free forwards: a rollout's sequences packed back to back into one row.

A rollout is stored padded ([N, P + C]: left-padded prompts, right-padded completions); a
forward over it would spend most of its work on padding when lengths spread. A packed
micro-batch holds only real tokens:

    input_ids     [1, S]   the rows' prompt + completion tokens, back to back
    position_ids  [1, S]   restart at 0 with each sequence
    cu_seqlens    [n + 1]  sequence boundaries (flash-attention's varlen layout)

so the model's dense layers and the LM head see no padding at all. Attention must keep
each sequence to itself: with ``flash_attention_2`` transformers reads ``cu_seq_lens_*``
and runs the varlen kernel; otherwise :func:`packed_attention` switches the model to
:func:`packed_sdpa`, which gathers the packed queries, keys and values onto a
[n, heads, longest, d] grid and makes one causal SDPA call (exact: a real query attends only
to real keys of its own sequence). The grid costs n * longest^2 in attention alone, against
S^2 for the block-diagonal mask transformers builds from restarting ``position_ids``
(measured 2-3x slower than the grid on the demo's 128 short sequences).

The LM head runs only at the positions that predict completion tokens (``logits_to_keep``),
so the logits are [1, Nc, V] (the hidden states [Nc, H]) for the Nc completion tokens, and
the loss takes them as flat rows with their sequence boundaries ``completion_cu_seqlens``:
no padding anywhere. Only per-token values that a rollout stores (log-probs [N, C]) go to
the rows' [n, C] completion grid (:func:`to_grid`), which costs O(n * C).

A row's extent is its attention mask, never its completion mask: in a multi-turn rollout a
completion interleaves the model's tokens with a tool's output, whose tokens are real (context
for every forward pass: attention 1) but out of the loss (completion_mask 0, so that mask is no
prefix of ones). Here they are completion tokens like the model's (packed, attended to, their
log-probs computed); the loss, its token counts and the sampling correction read the
completion mask, which gives them weight 0 (``step.loss_inputs``; tests/test_tool_mask.py).
"""

import contextlib
from typing import NamedTuple

import torch

PACKED_ATTENTION = "grpo_fast_packed_sdpa"


class Packed(NamedTuple):
    """Rows ``rows`` of a padded rollout, packed (see the module docstring).

    targets [1, Nc] the completion tokens; logit_index [Nc] the packed positions whose
    logits predict them; completion_cu_seqlens [n + 1] the rows' boundaries among them;
    grid ``(row [Nc], col [Nc])`` their places in the rows' [n, C] completion grid, whose
    shape is ``grid_shape``.
    """

    rows: slice
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    targets: torch.Tensor
    logit_index: torch.Tensor
    completion_cu_seqlens: torch.Tensor
    grid: tuple
    grid_shape: tuple


def row_lengths(attention_mask: torch.Tensor, num_completion_tokens: int) -> list:
    """``[(real tokens, prompt tokens)]`` of each row of a padded rollout, read to the host once:
    what :func:`pack` and the micro-batch split need to know on the host."""
    P = attention_mask.shape[1] - num_completion_tokens
    return torch.stack([attention_mask.sum(1), attention_mask[:, :P].sum(1)], 1).long().tolist()


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    rows: slice,
    lengths: list | None = None,
) -> Packed:
    """Packs rows ``rows`` of a padded rollout: input_ids and attention_mask [N, P + C], the
    last C = ``num_completion_tokens`` columns the completions. A row's real tokens are
    those of its attention mask, in order. ``lengths``: the rows' :func:`row_lengths`, if
    already on the host (else read here)."""
    ids, real = input_ids[rows], attention_mask[rows].bool()
    n, L = ids.shape
    C = num_completion_tokens
    if lengths is None:
        lengths = row_lengths(attention_mask[rows], C)
    if any(prompt == 0 and total > 0 for total, prompt in lengths):
        raise ValueError("every row needs at least one prompt token: the first completion token is predicted from it")
    S = sum(total for total, _ in lengths)
    Nc = S - sum(prompt for _, prompt in lengths)
    # The real tokens' flat positions [S]; their count is known on the host, so finding them
    # needs no device-to-host read (nonzero_static, not a boolean index).
    flat = torch.nonzero_static(real.reshape(-1), size=S).squeeze(1)
    columns, row_of = flat % L, flat // L  # [S] each token's padded column and row
    # [Nc] packed positions of completion tokens (a row's completion tokens follow its prompt's)
    completion = torch.nonzero_static(columns >= L - C, size=Nc).squeeze(1)
    cu_seqlens = torch.tensor([0] + [total for total, _ in lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    completion_lengths = [total - prompt for total, prompt in lengths]
    completion_cu = torch.tensor([0] + completion_lengths, dtype=torch.int64).cumsum(0)
    packed_ids = ids.reshape(-1)[flat].unsqueeze(0)
    return Packed(
        rows=rows,
        input_ids=packed_ids,
        position_ids=(real.cumsum(1) - 1).reshape(-1)[flat].unsqueeze(0),
        cu_seqlens=cu_seqlens.to(ids.device),
        max_length=max((total for total, _ in lengths), default=0),
        targets=packed_ids[:, completion],
        logit_index=completion - 1,
        completion_cu_seqlens=completion_cu.to(ids.device),
        grid=(row_of[completion], columns[completion] - (L - C)),
        grid_shape=(n, C),
    )


def micro_batches(lengths: list, max_tokens: int | None, max_rows: int | None) -> list:
    """Consecutive row slices of at most ``max_tokens`` tokens (a longer row alone) and at most
    ``max_rows`` rows; None = no limit. ``lengths`` [N] are the rows' token counts."""
    slices, start, tokens = [], 0, 0
    for i, length in enumerate(lengths):
        over_budget = max_tokens is not None and tokens + length > max_tokens
        if (over_budget or (max_rows is not None and i - start == max_rows)) and i > start:
            slices.append(slice(start, i))
            start, tokens = i, 0
        tokens += length
    if len(lengths) > start:
        slices.append(slice(start, len(lengths)))
    return slices


def pack_micro_batches(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int, max_tokens, max_rows
) -> list:
    """A padded rollout's rows (input_ids and attention_mask [N, P + C]) packed into the
    :func:`micro_batches` of at most ``max_tokens`` tokens and ``max_rows`` rows, one read of
    the rows' lengths to the host: a :class:`Packed` each. A function of the tokens and the
    limits alone, so that a rollout worker packs a batch as the trainer will."""
    lengths = row_lengths(attention_mask, num_completion_tokens)
    slices = micro_batches([total for total, _ in lengths], max_tokens, max_rows)
    return [pack(input_ids, attention_mask, num_completion_tokens, rows, lengths[rows]) for rows in slices]


def to_grid(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-completion-token values [1, Nc] or [1, Nc, H] onto the rows' [n, C] (or [n, C, H])
    grid, 0 where a row has no token; differentiable."""
    values = values[0]
    grid = values.new_zeros(packed.grid_shape + values.shape[1:])
    return grid.index_put(packed.grid, values)


def packed_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    *,
    cu_seq_lens_q: torch.Tensor,
    max_length_q: int,
    **kwargs,
):
    """Attention of sequences packed in one row, each causal and to itself (a transformers
    attention function; see the module docstring).

    query [1, heads, S, d], key and value [1, kv_heads, S, d]; ``cu_seq_lens_q`` [n + 1] the
    sequence boundaries, ``max_length_q`` the longest. Returns ([1, S, heads, d], None).
    """
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            "packed_sdpa computes full causal attention; a model with a sliding window or logit softcapping needs "
            "attn_implementation='flash_attention_2' for packed sequences"
        )
    starts = cu_seq_lens_q[:-1].long()
    lengths = cu_seq_lens_q.diff().long()
    (heads, S, d), n, longest = query.shape[1:], len(lengths), max_length_q
    # Grid slot (i, j) reads packed position starts[i] + j; past a sequence's end that is some
    # other token, which no real query sees: causally, query j attends keys 0..j only.
    reads = (starts.unsqueeze(1) + torch.arange(longest, device=query.device)).clamp(max=S - 1).view(-1)
    seq = torch.repeat_interleave(torch.arange(n, device=query.device), lengths, output_size=S)
    slots = seq * longest + torch.arange(S, device=query.device) - starts[seq]  # [S] each token's grid slot

    def grid(x):  # [1, h, S, d] -> [n, h, longest, d]
        return x[0].index_select(1, reads).view(x.shape[1], n, longest, d).transpose(0, 1)

    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        grid(query), grid(key), grid(value), dropout_p=dropout, is_causal=True, scale=scaling
    )  # [n, h, longest, d]
    return out.transpose(1, 2).reshape(n * longest, heads, d).index_select(0, slots).unsqueeze(0), None


@contextlib.contextmanager
def packed_attention(model):
    """Inside the block ``model`` attends within packed sequences: flash-attention models as
    they are (they read ``cu_seq_lens_*``), any other through :func:`packed_sdpa`."""
    config = model.config
    saved = config._attn_implementation
    if saved is not None and saved.startswith("flash_attention"):
        yield model
        return
    from transformers import AttentionInterface

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield model
    finally:
        config._attn_implementation = saved


def _packed_inputs(packed: Packed) -> dict:
    cu, longest = packed.cu_seqlens, packed.max_length
    return dict(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    )


def packed_logits(model, packed: Packed) -> torch.Tensor:
    """The logits that predict the completion tokens: [1, Nc, V] (the LM head runs there only)."""
    with packed_attention(model):
        return model(**_packed_inputs(packed), logits_to_keep=packed.logit_index).logits


def packed_hidden(model, packed: Packed) -> torch.Tensor:
    """The last hidden states (after the final norm) that predict the completion tokens: [Nc, H]."""
    with packed_attention(model):
        hidden = model.get_decoder()(**_packed_inputs(packed)).last_hidden_state
    return hidden[0, packed.logit_index]
