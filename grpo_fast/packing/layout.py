"""Padding-free layouts: a rollout's sequences packed back to back into one row.

A rollout is stored padded ([N, P + C]: left-padded prompts, right-padded completions); a
forward over it would spend most of its work on padding when lengths spread. A packed
micro-batch holds only real tokens:

    input_ids     [1, S]   the rows' prompt + completion tokens, back to back
    position_ids  [1, S]   restart at 0 with each sequence
    cu_seqlens    [n + 1]  sequence boundaries (flash-attention's varlen layout)

so the model's dense layers and the LM head see no padding at all (the attention that keeps
each sequence to itself is ``attention.py``'s). The LM head runs only at the positions that
predict completion tokens (``logit_index``), so the loss takes the Nc completion tokens as
flat rows with their sequence boundaries ``completion_cu_seqlens``: no padding anywhere. Only
per-token values that a rollout stores (log-probs [N, C]) go to the rows' [n, C] completion
grid (:func:`to_grid`), which costs O(n * C).

Shared prefixes (``--shared-prefix``; ``groups``): rows that share their prompt (a GRPO
group's G rows) pack as one unit ``[prompt | completion_1 | ... | completion_g]``: the prompt
runs through the model once per micro-batch instead of G times (a group a micro-batch
boundary splits carries its prompt on both sides). A completion's positions continue from the
prompt's, as unshared; the prompt's last token predicts every completion's first
(``logit_index`` repeats it); :class:`SharedPrefix` marks each token's prompt or completion,
and :func:`attention_grids` makes the pack's attention (every pack's, shared or not) a few
SDPA calls on grids of like length. The outputs and gradients are those of the whole rows:
the prompt's gradient is the sum over its completions (tests/test_shared_prefix.py, to 1e-10
in float64).

A row's extent is its attention mask, never its completion mask: in a multi-turn rollout a
completion interleaves the model's tokens with a tool's output, whose tokens are real (context
for every forward pass: attention 1) but out of the loss (completion_mask 0, so that mask is no
prefix of ones). Here they are completion tokens like the model's (packed, attended to, their
log-probs computed); the loss, its token counts and the sampling correction read the
completion mask, which gives them weight 0 (``step.loss_inputs``; tests/test_tool_mask.py).
"""

import functools
import itertools
import logging
from typing import NamedTuple

import torch

from grpo_fast.packing.cost import PackCost
from grpo_fast.packing.grids import Grids, attention_grids, layer_seconds, whole_row_spans

logger = logging.getLogger("grpo_fast")

# The kernels a pack is attended with: SDPA on gathered grids (exact on every device), or
# FlexAttention with a block mask (compiled on CUDA; on CPU it runs unfused, for tests).
ATTENTIONS = ("sdpa", "flex")


class Packed(NamedTuple):
    """Rows ``rows`` of a padded rollout, packed (see the module docstring).

    targets [1, Nc] the completion tokens; logit_index [Nc] the packed positions whose
    logits predict them; completion_cu_seqlens [n + 1] the rows' boundaries among them;
    grid ``(row [Nc], col [Nc])`` their places in the rows' [n, C] completion grid, whose
    shape is ``grid_shape``; ``attention`` the kernel of :data:`ATTENTIONS` that attends it
    (flash-attention models run their own); ``grids`` the SDPA calls that attend it (with
    ``attention="sdpa"``; see :func:`attention_grids`).
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
    prefix: "SharedPrefix | None" = None
    attention: str = "sdpa"
    grids: "Grids | None" = None


class SharedPrefix(NamedTuple):
    """What makes a pack shared-prefix (``pack(..., groups=...)``): U units ``[prompt |
    completion_1 | ... | completion_g]``, M completions among them. Per packed token [S]:
    ``prompt`` whether it is a prompt token, ``segment`` its prompt's unit (0..U-1) or its
    completion (U..U+M-1). A query sees the keys of its unit, causally, that are its prompt's or
    its own segment's (FlexAttention's block mask reads these; SDPA runs the pack's ``grids``).
    """

    prompt: torch.Tensor
    segment: torch.Tensor


def row_lengths(
    attention_mask: torch.Tensor, num_completion_tokens: int, input_ids=None, group_size: int | None = None
) -> list:
    """``[(real tokens, prompt tokens)]`` of each row of a padded rollout, read to the host once:
    what :func:`pack` and the micro-batch split need to know on the host. With ``input_ids``
    and ``group_size`` G, ``[(real, prompt, same)]``: ``same`` whether the row's prompt is the
    previous row's of its group (never for a group's first row, ``G * k``), in the same read."""
    P = attention_mask.shape[1] - num_completion_tokens
    columns = [attention_mask.sum(1), attention_mask[:, :P].sum(1)]
    if _checked(group_size) is not None:
        if attention_mask.shape[0] % group_size:
            raise ValueError(f"group_size={group_size} must divide the rollout's {attention_mask.shape[0]} rows")
        prompts = _prompt_keys(input_ids, attention_mask, P)
        same = torch.zeros_like(columns[0], dtype=torch.bool)
        same[1:] = (prompts[1:] == prompts[:-1]).all(1)
        same[::group_size] = False
        columns.append(same)
    return torch.stack(columns, 1).long().tolist()


def _prompt_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int) -> torch.Tensor:
    """[N, 2P]: rows with equal prompts have equal keys (the tokens and the mask: a real token 0
    is not padding)."""
    mask = attention_mask[:, :P]
    return torch.cat([input_ids[:, :P] * mask, mask], 1)


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    rows: slice,
    lengths: list | None = None,
    groups: list | None = None,
    padded_positions: bool = False,
    attention: str = "sdpa",
    cost: PackCost | None = None,
) -> Packed:
    """Packs rows ``rows`` of a padded rollout: input_ids and attention_mask [N, P + C], the
    last C = ``num_completion_tokens`` columns the completions. A row's real tokens are
    those of its attention mask, in order. ``lengths``: the rows' :func:`row_lengths`, if
    already on the host (else read here).

    ``groups``: a key per row of the slice; consecutive rows with equal keys share their prompt
    (a GRPO group, or a run of equal prompts), which is then packed once, as
    ``[prompt | completion_1 | ... | completion_g]`` (see :class:`SharedPrefix`). None packs
    every row whole. ``padded_positions``: a token's position is its padded column (what a
    padded forward without ``position_ids`` uses, as TRL's does) instead of its index among
    the row's real tokens. ``attention``: the kernel that attends it, one of :data:`ATTENTIONS`.
    ``cost``: the model's :class:`~grpo_fast.packing.cost.PackCost` on this device, which splits
    the attention into calls and packs whole rows where the shared layout is predicted to cost
    more than it saves (:func:`_shares`); None: the device's costs at a reference width, and
    the layout ``groups`` asks for."""
    ids, real = input_ids[rows], attention_mask[rows].bool()
    n, L = ids.shape
    C = num_completion_tokens
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if groups is not None and len(groups) != n:
        raise ValueError(f"groups must hold one key per row of the slice ({n}), got {len(groups)}")
    if lengths is None:
        lengths = row_lengths(attention_mask[rows], C)
    if any(prompt == 0 and total > 0 for total, prompt in lengths):
        raise ValueError("every row needs at least one prompt token: the first completion token is predicted from it")
    if not any(total > prompt for total, prompt in lengths) or (groups is not None and len(set(groups)) == n):
        groups = None  # no completion token to share a prompt for, or no prompt shared
    units = _units(rows, lengths, groups)  # [(first row, rows)] in this micro-batch
    prompts = [lengths[first][1] for first, _ in units]
    completion_lengths = [total - prompt for total, prompt in lengths]
    if groups is not None and cost is not None and not _shares(cost, lengths, units, prompts, completion_lengths):
        groups, units = None, _units(rows, lengths, None)
    cost = cost or PackCost.reference(ids.device)
    Nc = sum(completion_lengths)
    S = Nc + sum(prompts) if groups is not None else sum(total for total, _ in lengths)
    # The real tokens' flat positions [S]; their count is known on the host, so finding them
    # needs no device-to-host read (nonzero_static, not a boolean index). Shared: a unit's
    # later rows keep their completion tokens only.
    keep = real.clone()
    if groups is not None:
        later = torch.ones(n, dtype=torch.bool)
        later[[first for first, _ in units]] = False
        keep[later.to(ids.device), : L - C] = False
    flat = torch.nonzero_static(keep.reshape(-1), size=S).squeeze(1)
    columns, row_of = flat % L, flat // L  # [S] each token's padded column and row
    # [Nc] packed positions of completion tokens (a row's completion tokens follow its prompt's)
    completion = torch.nonzero_static(columns >= L - C, size=Nc).squeeze(1)
    if groups is None:
        sequences, logit_index, prefix = [total for total, _ in lengths], completion - 1, None
        spans = whole_row_spans(sequences)
    else:
        sequences = [p + sum(completion_lengths[r] for r in members) for p, (_, members) in zip(prompts, units)]
        spans = _shared_spans(units, prompts, completion_lengths)
        logit_index, prefix = _shared_layout(units, prompts, completion_lengths, completion, ids.device)
    cu_seqlens = torch.tensor([0] + sequences, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    completion_cu = torch.tensor([0] + completion_lengths, dtype=torch.int64).cumsum(0)
    packed_ids = ids.reshape(-1)[flat].unsqueeze(0)
    return Packed(
        rows=rows,
        input_ids=packed_ids,
        # A completion's positions continue from its prompt's, shared or not.
        position_ids=(columns if padded_positions else (real.cumsum(1) - 1).reshape(-1)[flat]).unsqueeze(0),
        cu_seqlens=cu_seqlens.to(ids.device),
        max_length=max(sequences, default=0),
        targets=packed_ids[:, completion],
        logit_index=logit_index,
        completion_cu_seqlens=completion_cu.to(ids.device),
        grid=(row_of[completion], columns[completion] - (L - C)),
        grid_shape=(n, C),
        prefix=prefix,
        attention=attention,
        grids=attention_grids(spans, S, ids.device, cost) if attention == "sdpa" else None,
    )


def _checked(group_size):
    """``group_size``, a positive int or None; else a ValueError naming it."""
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    return group_size


def _units(rows: slice, lengths: list, groups: list | None) -> list:
    """``[(first row, [rows])]`` (indices within the slice) of the packed units: each row alone,
    or the runs of consecutive rows with one key of ``groups`` (a group the micro-batch splits
    gives a unit on each side)."""
    if groups is None:
        return [(i, [i]) for i in range(len(lengths))]
    units = []
    for i, key in enumerate(groups):
        if i and key == groups[i - 1]:
            units[-1][1].append(i)
        else:
            units.append((i, [i]))
    for _, members in units:
        if len({lengths[i][1] for i in members}) > 1:
            raise ValueError(
                f"rows {[rows.start + i for i in members]} of one group have prompts of different lengths "
                f"{[lengths[i][1] for i in members]}; a group's rows must share their prompt"
            )
    return units


def _shared_spans(units: list, prompts: list, completion_lengths: list) -> list:
    """The :func:`attention_grids` spans of a shared-prefix pack: each unit's prompt, causal to
    itself, then its completions, each after the prompt."""
    spans, start = [], 0
    for prompt, (_, members) in zip(prompts, units):
        prompt_start, start = start, start + prompt
        spans.append((prompt_start, prompt, 0, 0))
        for r in members:
            spans.append((start, completion_lengths[r], prompt_start, prompt))
            start += completion_lengths[r]
    return spans


def _shared_layout(units: list, prompts: list, completion_lengths: list, completion, device):
    """The logit index [Nc] of a shared-prefix pack (a completion's first token is predicted by
    its unit's last prompt token) and its :class:`SharedPrefix`, from the host's lengths."""
    segments, start = [], 0  # segments: (id, is a prompt, tokens)
    # Each completion's first token comes from its unit's last prompt position; the others
    # from the position before them, as unshared: (its index among the Nc, the predictor)
    firsts, predictors, completed = [], [], 0
    for u, (prompt, (_, members)) in enumerate(zip(prompts, units)):
        prompt_start, start = start, start + prompt
        segments.append((u, True, prompt))
        for r in members:  # the units hold the rows in order: completion r is segment U + r
            segments.append((len(units) + r, False, completion_lengths[r]))
            if completion_lengths[r]:
                firsts.append(completed)
                predictors.append(prompt_start + prompt - 1)
            start += completion_lengths[r]
            completed += completion_lengths[r]
    ids, is_prompt, tokens = (torch.tensor(column) for column in zip(*segments))
    prefix = SharedPrefix(
        prompt=torch.repeat_interleave(is_prompt, tokens, output_size=start).to(device),
        segment=torch.repeat_interleave(ids, tokens, output_size=start).to(device),
    )
    firsts, predictors = (torch.tensor(column, dtype=torch.long).to(device) for column in (firsts, predictors))
    return (completion - 1).index_put((firsts,), predictors), prefix


def _shares(cost: PackCost, lengths: list, units: list, prompts: list, completion_lengths: list) -> bool:
    """Whether a micro-batch's shared layout is predicted to cost less than its whole rows (one
    layer's forward, ``cost``); the first time it is not, that is logged once per process."""
    whole = [total for total, _ in lengths]
    shared = (sum(prompts) + sum(completion_lengths), _shared_spans(units, prompts, completion_lengths))
    layouts = (shared, (sum(whole), whole_row_spans(whole)))
    seconds = [layer_seconds(tokens, spans, cost) for tokens, spans in layouts]
    if seconds[0] < seconds[1]:
        return True
    _say_whole_rows()
    logger.debug(
        "shared_prefix: whole rows, predicted %.3g ms a layer shared against %.3g ms", *(t * 1e3 for t in seconds)
    )
    return False


@functools.cache
def _say_whole_rows() -> None:
    logger.info(
        "shared_prefix: packing whole rows for micro-batches where sharing is predicted to cost more than it "
        "saves (short prompts; grpo_fast.packing.cost); said once"
    )


def pack_by_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int, **options):
    """Rows input_ids and attention_mask [N, P + C] (the last C = ``num_completion_tokens``
    columns the completions) packed in one micro-batch, the rows with equal prompts sharing
    theirs wherever they are in the batch (a shuffled batch's groups): they are packed as runs
    of equal prompts, and the pack's ``grid`` maps its tokens back to the given rows, so that
    :func:`to_grid` writes [N, C] in the caller's order. Whole rows when no prompt repeats.
    ``options``: :func:`pack`'s ``padded_positions`` and ``cost``."""
    N, P = input_ids.shape[0], input_ids.shape[1] - num_completion_tokens
    _, key = torch.unique(_prompt_keys(input_ids, attention_mask, P), dim=0, return_inverse=True)
    order = torch.argsort(key, stable=True)
    groups = key[order].tolist()
    packed = pack(input_ids[order], attention_mask[order], num_completion_tokens, slice(0, N), groups=groups, **options)
    row, column = packed.grid
    return packed._replace(grid=(order.to(row.device)[row], column))


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
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    max_tokens,
    max_rows,
    group_size: int | None = None,
    attention: str = "sdpa",
    cost: PackCost | None = None,
) -> list:
    """A padded rollout's rows (input_ids and attention_mask [N, P + C]) packed into the
    :func:`micro_batches` of at most ``max_tokens`` tokens and ``max_rows`` rows, one read of
    the rows' lengths to the host: a :class:`Packed` each. ``group_size`` G: rows ``G * k`` to
    ``G * k + G - 1`` are a GRPO group, whose prompt is packed once per micro-batch (see
    :func:`pack`; rows of a group whose prompts differ, which a custom rollout source may
    give, pack as runs of equal prompts). A function of the tokens and the limits alone, so
    that a rollout worker packs a batch as the trainer will. The micro-batches are the same
    rows either way (the budget counts every row's prompt). ``attention`` and ``cost``:
    :func:`pack`'s."""
    lengths = row_lengths(attention_mask, num_completion_tokens, input_ids if group_size else None, group_size)
    groups = None
    if group_size is not None:  # a unit: a run of a group's rows with one prompt (a GRPO group has one)
        groups = list(itertools.accumulate(not same for _, _, same in lengths))
        lengths = [(total, prompt) for total, prompt, _ in lengths]
    slices = micro_batches([total for total, _ in lengths], max_tokens, max_rows)
    return [
        pack(
            input_ids,
            attention_mask,
            num_completion_tokens,
            rows,
            lengths[rows],
            groups and groups[rows],
            attention=attention,
            cost=cost,
        )
        for rows in slices
    ]


def to_grid(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-completion-token values [1, Nc] or [1, Nc, H] onto the rows' [n, C] (or [n, C, H])
    grid, 0 where a row has no token; differentiable."""
    values = values[0]
    grid = values.new_zeros(packed.grid_shape + values.shape[1:])
    return grid.index_put(packed.grid, values)
