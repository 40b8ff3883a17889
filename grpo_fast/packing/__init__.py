"""Padding-free forwards: a micro-batch's sequences back to back in one row, each shared
prompt once, and the attention that keeps each to itself.

    layout.py     the packed layout (:class:`Packed`, :func:`pack`, shared prefixes,
                  :func:`pack_by_prompt`), its SDPA calls (:func:`attention_grids`), the
                  token-budget micro-batches, :func:`to_grid`
    cost.py       what a packed layer costs (:class:`PackCost`): how the attention splits into
                  calls, and whether sharing a micro-batch's prompts pays
    attention.py  :func:`packed_sdpa` (whole rows and shared prefixes), the attention a model
                  is set to once (:func:`use_packed_attention`), the packed forwards
                  :func:`packed_logits` and :func:`packed_hidden`, what cannot take the layout
    sequence_parallel.py  Ulysses sequence parallelism: a pack's tokens across a group of
                  ranks (:func:`sequence_shard`), the all-to-all around its attention, the
                  per-token results gathered back (:func:`gather_tokens`)

The trainer and the TRL drop-in both pack with it; it imports nothing of theirs.
"""

from grpo_fast.packing.attention import (
    PACKED_ATTENTIONS,
    packed_hidden,
    packed_logits,
    packed_sdpa,
    shared_layout_blocker,
    use_packed_attention,
)
from grpo_fast.packing.cost import HOST_COSTS, HostCost, LayerShape, PackCost
from grpo_fast.packing.grids import Grid, Grids, attention_grids
from grpo_fast.packing.layout import (
    ATTENTIONS,
    Packed,
    SharedPrefix,
    micro_batches,
    pack,
    pack_by_prompt,
    pack_micro_batches,
    row_lengths,
    to_grid,
)
from grpo_fast.packing.sequence_parallel import (
    Shard,
    check_heads,
    gather_tokens,
    sequence_shard,
    ulysses_all_to_all,
)

__all__ = [
    "ATTENTIONS",
    "HOST_COSTS",
    "PACKED_ATTENTIONS",
    "Grid",
    "Grids",
    "HostCost",
    "LayerShape",
    "PackCost",
    "Packed",
    "Shard",
    "SharedPrefix",
    "attention_grids",
    "check_heads",
    "gather_tokens",
    "micro_batches",
    "pack",
    "pack_by_prompt",
    "pack_micro_batches",
    "packed_hidden",
    "packed_logits",
    "packed_sdpa",
    "row_lengths",
    "sequence_shard",
    "shared_layout_blocker",
    "to_grid",
    "ulysses_all_to_all",
    "use_packed_attention",
]
