"""The attention of a pack as a few SDPA calls on grids (:func:`attention_grids`).

A pack's tokens fall in query spans, each attending causally to itself, or to a prefix (its
prompt, in a shared-prefix pack) and then causally to itself. Spans of like length share a
call on a [rows, queries] grid, as the host's cost model (``cost.py``) predicts pays: a call
has a fixed cost, but a grid's padding costs too. A call of spans after a prefix attends its
queries against [prefix | span] keys under a mask, or, where the model predicts that no slower,
as causal rows of [prefix | span] whose prefix outputs are dropped: no mask, and the kernel
skips the pairs above the diagonal. ``attention.packed_sdpa`` runs the calls.
"""

import itertools
from typing import NamedTuple

import torch

from grpo_fast.packing.cost import PackCost


class Grid(NamedTuple):
    """One SDPA call of a pack's attention (:class:`Grids`): ``rows`` query spans on a [rows,
    queries] grid against [rows, keys] keys. ``key_mask`` None: each row attends causally to
    itself (its keys are its queries, ``keys == queries``): a span, or a span after its prefix
    with the prefix's tokens replayed as queries whose outputs are dropped. Else each span
    attends to a prefix (its prompt), padded to the longest, then causally to itself:
    ``key_mask`` [rows, or 1 where every row's prefix is the longest, 1, queries, keys] the keys
    each query sees (always its prefix's first, so no row is empty, even at the grid's padding,
    whose outputs are dropped), and ``prefixes`` [rows] the prefixes' lengths
    (:func:`window_mask` reads them)."""

    rows: int
    queries: int
    keys: int
    key_mask: torch.Tensor | None = None
    prefixes: torch.Tensor | None = None


class Grids(NamedTuple):
    """A pack's attention as a few SDPA calls (:func:`attention_grids`): ``calls`` a tuple of
    :class:`Grid`, each over spans of like length. ``query_reads`` [sum of rows * queries] and
    ``key_reads`` [sum of rows * keys]: the packed positions that fill the calls' grids, one
    call after another (one gather each for all calls, so the backward scatters once); past a
    span's end a grid reads positions no real query sees. ``slots`` [S]: each packed token's
    row in the calls' outputs, flattened and concatenated."""

    calls: tuple
    query_reads: torch.Tensor
    key_reads: torch.Tensor
    slots: torch.Tensor


def _calls(spans: list, cost: PackCost) -> list:
    """``[[prefix width, query width, [span indices], replayed]]``: ``spans`` (see
    :func:`attention_grids`) split into SDPA calls, first-fit, largest first. A call takes a span
    of its kind (causal, or after a prefix: a causal grid takes no mask, a prefixed one needs it)
    where the call padded to take it is predicted to cost less than the span's own call
    (``cost``): a call has a fixed cost, so short spans share one, but a grid's padding costs
    too, so unlike lengths do not (one grid over rows of 20 to 300 tokens spent 4x the attention
    of a call per row on CPU, benchmarks/NOTES.md, "Attention on grids of like length").
    ``replayed`` (:func:`_replays_prefix`): a prefixed call attended as causal rows."""

    def seconds(rows, prefix, length):
        return cost.call_seconds(*_call_shape(rows, prefix, length, False))

    calls = []
    for i in sorted(range(len(spans)), key=lambda i: spans[i][1] * (spans[i][1] + spans[i][3]), reverse=True):
        _, length, _, prefix = spans[i]
        if length == 0:
            continue
        for call in calls:
            if (call[0] > 0) != (prefix > 0):
                continue
            P, R, rows = max(call[0], prefix), max(call[1], length), len(call[2])
            if seconds(rows + 1, P, R) <= seconds(rows, call[0], call[1]) + seconds(1, prefix, length):
                call[:2] = P, R
                call[2].append(i)
                break
        else:
            calls.append([prefix, length, [i]])
    return [[P, R, members, _replays_prefix(spans, P, R, members, cost)] for P, R, members in calls]


def _replays_prefix(spans: list, P: int, R: int, members: list, cost: PackCost) -> bool:
    """Whether a call of spans after prefixes of width ``P`` attends causally over rows of
    [prefix | span], the prefix's tokens replayed as queries whose outputs are dropped, rather
    than the span's queries against [prefix | span] keys under a mask. Causal rows hold no mask
    (whose bytes grow as R x (P + R), SDPA's float copy of it included) and let the kernel skip
    the keys above the diagonal, for the prefix's P x (P + R) / 2 pairs more; a span whose
    prefix is shorter than ``P`` would see the padding, so every one must be ``P`` long. Where
    the cost model predicts no more time than the mask's."""
    if not P or any(spans[i][3] != P for i in members):
        return False
    rows = len(members)
    return cost.call_seconds(*_call_shape(rows, P, R, True)) <= cost.call_seconds(*_call_shape(rows, P, R, False))


def _call_shape(rows: int, P: int, R: int, replayed: bool) -> tuple:
    """:meth:`PackCost.call_seconds`'s ``(rows, queries, keys, masked)`` of a call of ``rows``
    spans of width ``R`` after prefixes of width ``P`` (0: none), replayed or not."""
    return (rows, P + R, P + R, False) if replayed else (rows, R, P + R, P > 0)


def layer_seconds(tokens: int, spans: list, cost: PackCost) -> float:
    """One layer's forward over a pack of ``tokens`` attended as ``spans`` (see
    :func:`attention_grids`), predicted by ``cost`` for the calls :func:`attention_grids` makes."""
    return cost.seconds(tokens, [_call_shape(len(m), P, R, replayed) for P, R, m, replayed in _calls(spans, cost)])


def attention_grids(spans: list, total: int, device, cost: PackCost | None = None) -> Grids:
    """The :class:`Grids` that attend a pack of ``total`` tokens on ``device``. ``spans``: per
    query span ``(start, length, prefix start, prefix length)`` in packed positions, a prefix
    length of 0 for a span that attends causally to itself alone (a whole row, a shared
    prompt), else to its prefix and causally to itself (a completion after its shared prompt).
    Every packed token is in exactly one span. The calls are :func:`_calls`' under ``cost``
    (None: :meth:`PackCost.reference` on ``device``)."""
    if sum(length for _, length, _, _ in spans) != total:
        raise ValueError(f"spans must hold each of the {total} packed tokens once, got {spans}")
    calls = _calls(spans, cost or PackCost.reference(device))
    last, arange = max(total - 1, 0), torch.arange
    grids, query_reads, key_reads = [], [arange(0)], [arange(0)]
    slots, offset = torch.empty(total, dtype=torch.long), 0
    for P, R, members, replayed in calls:
        columns = zip(*(spans[i] for i in members))
        starts, lengths, prefix_starts, prefixes = (torch.tensor(column) for column in columns)
        queries = (starts[:, None] + arange(R)).clamp(max=last)  # [r, R]
        keys, mask, skipped = queries, None, 0
        if P:
            keys = torch.cat([(prefix_starts[:, None] + arange(P)).clamp(max=last), queries], 1)  # [r, P + R]
        if replayed:  # causal rows of [prefix | span]: the prefix's outputs are dropped
            queries, skipped = keys, P
        elif P:
            # one mask broadcast over the rows where every row's is the same (each prefix P long)
            masks = 1 if bool((prefixes == P).all()) else len(members)
            seen_prefix = (arange(P) < prefixes[:masks, None])[:, None, :].expand(-1, R, -1)  # [m, R, P]
            causal = torch.ones(R, R, dtype=torch.bool).tril().expand(masks, -1, -1)
            mask = torch.cat([seen_prefix, causal], 2)[:, None].to(device)  # [m, 1, R, P + R]
        width = queries.shape[1]
        grids.append(Grid(len(members), width, keys.shape[1], mask, prefixes.to(device) if mask is not None else None))
        query_reads.append(queries.reshape(-1))
        key_reads.append(keys.reshape(-1))
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
            slots[start : start + length] = offset + row * width + skipped + arange(length)
        offset += len(members) * width
    reads = (torch.cat(query_reads).to(device), torch.cat(key_reads).to(device))
    return Grids(tuple(grids), *reads, slots.to(device))


def window_mask(call: Grid, window: int, device) -> torch.Tensor | None:
    """The keys each query of ``call`` sees under a sliding window of ``window`` positions (a
    query at position i sees keys at positions j with i - window < j <= i, as transformers'
    sliding layers do), [rows or 1, 1, queries, keys] on ``device``; None when no span of the
    call reaches that far (its own mask, or causality, already holds). Positions count from
    each unit's start: a completion's first query sits right after its prefix."""
    if call.keys <= window:
        return None
    offsets = torch.arange(call.queries, device=device)
    if call.key_mask is None:  # causal: the keys are the queries
        distance = offsets[:, None] - offsets[None, :]  # [R, R]
        return ((distance >= 0) & (distance < window))[None, None]
    query_positions = call.prefixes[:, None] + offsets  # [r, R]
    prefix_positions = torch.arange(call.keys - call.queries, device=device).expand(call.rows, -1)
    key_positions = torch.cat([prefix_positions, query_positions], 1)  # [r, P + R]
    near = (query_positions[:, :, None] - key_positions[:, None, :]) < window  # [r, R, P + R]
    return call.key_mask & near[:, None]


def whole_row_spans(lengths: list) -> list:
    """The :func:`attention_grids` spans of sequences of ``lengths`` packed back to back, each
    causal and to itself."""
    return [(start, length, 0, 0) for start, length in zip(itertools.accumulate(lengths, initial=0), lengths)]
