"""What a packed layer's forward costs, predicted from the pack's layout and the model's shape.

Two decisions read it (``layout.py``):

- how a pack's attention spans split into SDPA calls: a call pays a fixed cost, so spans
  share one while the padding that costs is less than another call (:meth:`PackCost.call_seconds`);
- whether a micro-batch's groups share their prompts: the shared layout runs fewer tokens
  through the dense layers, but attends its completions on masked calls (slower per pair than
  causal ones) and gathers each prompt's keys once per completion. Where the prediction says
  that costs more than it saves, as with short prompts before long completions, the micro-batch
  packs whole rows (:meth:`PackCost.seconds`).

One layer's forward, in seconds::

    tokens x dense FLOPs a token x flop
    + sum over calls (call + rows x width x row + rows x pairs x width x (causal or masked)
                      + elements gathered into and out of the grid x gather)

where a masked call's pairs are queries x keys, and a causal call's the pairs its kernel
computes: it skips the key blocks past each query block's diagonal, about queries x (keys +
block) / 2 of them, fewer than queries x keys once a row is longer than the kernel's key block
(:func:`attended_pairs`).

The backward costs about twice each term, so the forward's ratio is the pass's. The LM head,
the embeddings and the loss are the same in every layout and left out. The seconds per unit
(:class:`HostCost`) are fitted per device type by ``benchmarks/fit_pack_cost.py`` and written
here, not timed at start-up: a layout chosen from a clock would differ between two runs of one
seed, and so would their float32 results.
"""

from typing import NamedTuple

import torch


class HostCost(NamedTuple):
    """Seconds per unit of a packed forward's work on one device type (fitted, see the module
    docstring): ``flop`` per dense FLOP; ``call`` an SDPA call's fixed cost, ``row`` a grid
    row's per head channel, ``causal`` and ``masked`` per query-key pair and head channel of a
    call, causal or with a mask; ``gather`` per element copied into or out of the grids;
    ``block`` the keys the attention kernel takes at a time (not fitted: the kernel's)."""

    flop: float
    call: float
    row: float
    causal: float
    masked: float
    gather: float
    block: int


# cpu: fitted on the 2-core development host, one thread (benchmarks/NOTES.md, issue 52); its
# block is ATen's CPU flash kernel's key split (512), so the fit's calls of at most 512 keys
# count every pair. cuda: an H100's dense peak at half utilisation and about 10 us a small call
# (launches and a grid too small to fill the device), flash-attention's blocks of 128 keys; not
# yet fitted: no GPU has been lent.
HOST_COSTS = {
    "cpu": HostCost(flop=1.41e-11, call=6.3e-6, row=1.9e-8, causal=7.2e-11, masked=7.5e-11, gather=1.5e-10, block=512),
    "cuda": HostCost(flop=2.0e-15, call=1.0e-5, row=0.0, causal=2.0e-15, masked=3.0e-15, gather=1.0e-12, block=128),
}


def attended_pairs(queries: int, keys: int, masked: bool, block: int) -> float:
    """The query-key pairs an SDPA call computes for one row and head channel: all of them under
    a mask; causally (``keys == queries``) the ones up to each query block's diagonal, rounded
    up to the kernel's key ``block``: about queries x (keys + block) / 2, at most all."""
    return queries * (keys if masked else min(keys, (keys + block) / 2))


class LayerShape(NamedTuple):
    """A decoder layer's shape as the cost model reads it: ``flops`` of its dense layers per
    token (forward), ``width`` its query heads x head size, ``kv_width`` its key (and value)
    heads x head size."""

    flops: int
    width: int
    kv_width: int

    @classmethod
    def of(cls, config) -> "LayerShape":
        """From a transformers config (a multimodal one's text config): attention projections of
        ``num_attention_heads`` and ``num_key_value_heads`` heads of ``head_dim``, and a gated
        MLP of ``intermediate_size`` (three matrices, as Llama, Qwen, Gemma and Mistral)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, heads = text.hidden_size, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        width = heads * head_dim
        kv_width = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
        weights = hidden * (2 * width + 2 * kv_width) + 3 * hidden * text.intermediate_size
        return cls(flops=2 * weights, width=width, kv_width=kv_width)


class PackCost(NamedTuple):
    """The cost model of one model's packs on one device type."""

    host: HostCost
    shape: LayerShape

    @classmethod
    def of(cls, model, device) -> "PackCost":
        """``model``'s (a transformers model, or a peft model of one) on ``device``'s type."""
        return cls(HOST_COSTS.get(torch.device(device).type, HOST_COSTS["cuda"]), LayerShape.of(model.config))

    @classmethod
    def reference(cls, device) -> "PackCost":
        """``device``'s type's costs at a reference width of 256 (4 heads of 64), for a pack
        whose model is not known: its calls split as for such a model."""
        return cls(HOST_COSTS.get(torch.device(device).type, HOST_COSTS["cuda"]), LayerShape(0, 256, 256))

    def call_seconds(self, rows: int, queries: int, keys: int, masked: bool) -> float:
        """One SDPA call on a grid of ``rows`` x ``queries`` queries against ``keys`` keys, with
        its gathers in and out."""
        host, width = self.host, self.shape.width
        pairs = rows * attended_pairs(queries, keys, masked, host.block) * width
        gathered = rows * (2 * queries * width + 2 * keys * self.shape.kv_width)
        return (
            host.call
            + rows * width * host.row
            + pairs * (host.masked if masked else host.causal)
            + gathered * host.gather
        )

    def seconds(self, tokens: int, calls: list) -> float:
        """One layer's forward over ``tokens`` packed tokens attended by ``calls``, each
        ``(rows, queries, keys, masked)``."""
        dense = tokens * self.shape.flops * self.host.flop
        return dense + sum(self.call_seconds(*call) for call in calls)
