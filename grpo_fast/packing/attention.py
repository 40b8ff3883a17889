"""The attention of a packed micro-batch (``layout.py``), and the packed forwards.

Attention must keep each sequence to itself: with ``flash_attention_2`` transformers reads
``cu_seq_lens_*`` and runs the varlen kernel; otherwise :func:`packed_sdpa` gathers the packed
queries, keys and values onto grids and makes one SDPA call per grid (exact: a real query
attends only to real keys of its own sequence). A grid holds sequences of like length
(``grids.attention_grids``): one grid over a micro-batch costs n * longest^2 in attention,
which on rows of 20 to 300 tokens was 4x the work of the rows themselves; the block-diagonal
S x S mask transformers builds from restarting ``position_ids`` costs S^2 (measured 2-3x slower
than one grid on the demo's 128 short sequences), so a packed forward hands the model a ready,
empty mask and transformers builds none.

A shared-prefix pack (:class:`~grpo_fast.packing.layout.SharedPrefix`) attends each prompt
causally to itself and each completion to its prompt and causally to itself, never to another
completion: the prompts on causal grids, the completions on grids of [its prompt | itself]
keys with a mask, or, where the cost model says so (``grids._replays_prefix``), on causal
grids of [its prompt | itself] rows whose prompt outputs are dropped; no S x S mask anywhere.
A sliding-window layer masks, on the calls whose
spans reach past its window, the keys further back than the window (positions counted within
each unit, as in the whole row). flash-attention's varlen kernel cannot take the shared layout,
nor can :func:`packed_sdpa` take logit softcapping, so those models pack whole rows
(:func:`shared_layout_blocker`).

How a model reaches :func:`packed_sdpa`: :func:`use_packed_attention`, where the model is
built, sets its attention implementation once to a name registered through transformers'
``AttentionInterface.register`` (``PACKED_ATTENTIONS``: one per implementation it wraps, sdpa
or eager, each with that implementation's masks). The function under the name looks at each
call's keyword arguments, which transformers hands from the forward down to every attention
call: a pack's ``packed_grids`` or ``flex_block_mask`` send it to :func:`packed_sdpa`, anything
else to the model's own attention with its own mask, so generation and any unpacked forward
attend as before. Nothing is switched per forward: gradient checkpointing replays a layer's
keywords when it recomputes it, and two models, or two threads, packed and not, share nothing.
"""

import functools
import logging
import sys

import torch

from grpo_fast.base_model import base_model
from grpo_fast.packing.grids import Grids, attention_grids, whole_row_spans, window_mask
from grpo_fast.packing.layout import Packed
from grpo_fast.packing.sequence_parallel import Shard, ulysses_attention

logger = logging.getLogger("grpo_fast")

# The attention implementations a packed model can have had, and the name each becomes. A name
# per implementation (not one) so that unpacked calls keep that implementation's masks, which
# transformers picks by the name: SDPA's boolean masks, eager's additive ones.
PACKED_ATTENTIONS = {"sdpa": "grpo_fast_packed_sdpa", "eager": "grpo_fast_packed_eager"}
_ORIGINALS = {name: original for original, name in PACKED_ATTENTIONS.items()}
_sdpa = torch.nn.functional.scaled_dot_product_attention


def _on_flash(model) -> bool:
    """Whether ``model`` attends with flash-attention, whose varlen kernel reads the pack's
    ``cu_seq_lens_*`` itself (no :func:`packed_sdpa`, no block mask)."""
    return (model.config._attn_implementation or "").startswith("flash_attention")


def use_packed_attention(model):
    """``model`` (a transformers causal LM, or a peft model of one), its attention set to the
    packed attention once: the name in ``PACKED_ATTENTIONS`` of its implementation, registered
    in this process (see the module docstring). Idempotent: a model already set (a copy, or one
    unpickled in a worker process) gets the registration only; a flash-attention model is left
    as it is. Returns ``model``. Raises ValueError for another implementation, or a model whose
    attention does not go through transformers' ``AttentionInterface``."""
    base = base_model(model)
    if _on_flash(base):
        return model
    current = base.config._attn_implementation
    original = _ORIGINALS.get(current, current)
    if original not in PACKED_ATTENTIONS:
        raise ValueError(
            f"packed sequences need attn_implementation 'sdpa', 'eager' or 'flash_attention_2'; model has {current!r}"
        )
    name = _register(original)
    if current != name:
        base.set_attn_implementation(name)
    if base.config._attn_implementation != name:  # transformers declined, and said why in its log
        raise ValueError(
            f"model ({type(base).__name__}) does not attend through transformers' AttentionInterface, so it cannot "
            "attend within packed sequences; load it with attn_implementation='flash_attention_2'"
        )
    return model


@functools.cache
def _register(original: str) -> str:
    """Registers, once per process, ``original``'s packed name: :func:`_attend` for its calls,
    ``original``'s mask function for its masks (none where ``original`` has none)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PACKED_ATTENTIONS[original]
    AttentionInterface.register(name, functools.partial(_attend, original))
    if original in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def _attend(original: str, module, query, key, value, attention_mask, *args, **kwargs):
    """The registered attention: :func:`packed_sdpa` for a call whose keywords carry a pack's
    grids or block mask (``_packed_inputs``), else the attention ``module``'s model runs under
    ``original``. Shapes as :func:`packed_sdpa`'s (transformers' attention functions'); a call
    whose keywords carry a ``sequence_shard`` (sequence parallelism) attends the whole pack across
    its group (``sequence_parallel.ulysses_attention``) and returns its shard's outputs."""
    if kwargs.get("packed_grids") is not None or kwargs.get("flex_block_mask") is not None:
        shard = kwargs.pop("sequence_shard", None)
        if shard is not None:
            return ulysses_attention(packed_sdpa, shard, module, query, key, value, attention_mask, *args, **kwargs)
        return packed_sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    return _own_attention(type(module), original)(module, query, key, value, attention_mask, *args, **kwargs)


def _own_attention(module_type: type, original: str):
    """The function ``module_type``'s forward calls under ``original``, looked up as its own
    code does: in its file's ``ALL_ATTENTION_FUNCTIONS`` (where a model may override an entry
    of transformers'), or its file's ``eager_attention_forward`` (eager: each model has its own).
    Two dictionary reads a call, uncached: torch.compile traces it (a compiled decode step)."""
    from transformers import AttentionInterface

    home = vars(sys.modules[module_type.__module__])
    if original == "eager":
        if "eager_attention_forward" not in home:
            raise ValueError(f"{module_type.__name__}'s module has no eager_attention_forward to fall back to")
        return home["eager_attention_forward"]
    return home.get("ALL_ATTENTION_FUNCTIONS", AttentionInterface())[original]


def shared_layout_blocker(model) -> str | None:
    """Why ``model``'s attention cannot run the shared layout (a phrase, logged once per
    process), or None: flash-attention's varlen kernel would let a completion see its group's
    other completions, and :func:`packed_sdpa` has no logit softcapping (it takes sliding
    windows)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if _on_flash(model):
        reason = (
            f"{model.config._attn_implementation} (its varlen kernel would let a group's completions see each other)"
        )
    elif getattr(text, "attn_logit_softcapping", None) is not None:
        reason = "attention logit softcapping"
    else:
        return None
    _whole_rows_for(reason)
    return reason


@functools.cache
def _whole_rows_for(reason: str) -> None:
    """Says once per process why every row is packed whole."""
    logger.info("shared_prefix: a model with %s cannot take the shared layout; every row is packed whole", reason)


def packed_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    *,
    packed_grids: Grids | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
):
    """Attention of sequences packed in one row, each causal and to itself, or shared-prefix
    units (a transformers attention function; see the module docstring).

    query [1, heads, S, d], key and value [1, kv_heads, S, d]; ``packed_grids`` the pack's
    :class:`~grpo_fast.packing.grids.Grids` (``Packed.grids``); without them, whole
    sequences with the boundaries ``cu_seq_lens_q`` [n + 1], whose grids are then built in every
    layer (a read of the boundaries to the host each). A sliding layer's ``sliding_window``
    (Gemma 2/3, Mistral) masks each call's keys past the window (``grids.window_mask``, only
    on calls whose spans reach past it). Returns ([1, S, heads, d], None).
    """
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "packed_sdpa has no attention logit softcapping; such a model needs "
            "attn_implementation='flash_attention_2' for packed sequences"
        )
    window = kwargs.get("sliding_window")
    if kwargs.get("flex_block_mask") is not None:
        if window is not None:
            raise ValueError(
                f"attention_kernel='flex' has no sliding window (this layer's is {window}); use attention_kernel='sdpa'"
            )
        return _flex(query, key, value, kwargs["flex_block_mask"], dropout, scaling), None
    if packed_grids is None:
        if cu_seq_lens_q is None:
            raise ValueError("packed_sdpa needs the pack's packed_grids, or cu_seq_lens_q for whole sequences")
        spans = whole_row_spans(cu_seq_lens_q.diff().tolist())
        packed_grids = attention_grids(spans, query.shape[2], query.device)
    # Grouped-query heads are gathered as they are, then passed to SDPA so (enable_gqa) where
    # its kernels take them, or each call's key and value grids repeated to the query heads.
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1 and _kernels_take_gqa(query)
    calls = packed_grids.calls

    def grids(x, reads, width):  # [1, h, S, d] -> each call's [rows, h, width, d], one gather
        flat = x[0].index_select(1, reads).split([call.rows * getattr(call, width) for call in calls], 1)
        return [part.view(x.shape[1], call.rows, -1, x.shape[3]).transpose(0, 1) for part, call in zip(flat, calls)]

    queries = grids(query, packed_grids.query_reads, "queries")
    keys, values = (grids(x, packed_grids.key_reads, "keys") for x in (key, value))
    outputs = []
    for call, q, k, v in zip(calls, queries, keys, values):
        if groups > 1 and not gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = call.key_mask if window is None else window_mask(call, window, query.device)
        mask = call.key_mask if mask is None else mask  # a window no span reaches changes nothing
        out = _sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa)
        outputs.append(out.transpose(1, 2).reshape(-1, query.shape[1], query.shape[3]))
    return torch.cat(outputs).index_select(0, packed_grids.slots).unsqueeze(0), None


def _kernels_take_gqa(query) -> bool:
    """Whether every SDPA call of a pack takes grouped-query heads as they are: on CPU its flash
    kernel does, masked or not (and 1.3x faster than on repeated heads, measured); on CUDA a
    masked call's memory-efficient kernel may not, and SDPA would fall back to its math path."""
    return not query.is_cuda


def flex_block_mask(packed: Packed):
    """FlexAttention's block mask of a pack (``packed.attention == "flex"``), built once per
    forward: a query sees the keys of its own unit, causally, that are its unit's prompt or of
    its own segment (a whole row is one segment; a shared-prefix unit has its prompt and each
    completion as segments). The layout's per-token ids [S] stay on the device."""
    from torch.nn.attention.flex_attention import create_block_mask

    S, device = packed.input_ids.shape[1], packed.input_ids.device
    cu = packed.cu_seqlens.long()
    unit = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff(), output_size=S)
    if packed.prefix is None:
        segment, prompt = unit, torch.zeros(S, dtype=torch.bool, device=device)
    else:
        segment, prompt = packed.prefix.segment, packed.prefix.prompt

    def visible(batch, head, q, k):
        return (unit[q] == unit[k]) & (k <= q) & (prompt[k] | (segment[q] == segment[k]))

    return create_block_mask(visible, None, None, S, S, device=device)


@functools.cache
def _flex_attention(compiled: bool):
    """FlexAttention, compiled (CUDA: the fused block-sparse kernel) or eager (CPU: unfused)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def _flex(query, key, value, block_mask, dropout: float, scaling):
    """One FlexAttention call over the whole pack (q [1, heads, S, d], k/v [1, kv_heads, S, d],
    grouped-query heads as they are); returns [1, S, heads, d]."""
    if dropout:
        raise ValueError(f"attention='flex' has no attention dropout; got dropout={dropout} (use attention='sdpa')")
    if not query.is_cuda and torch.is_grad_enabled() and query.requires_grad:
        raise ValueError(
            "attention='flex' trains on CUDA only (FlexAttention has no CPU backward); use attention='sdpa'"
        )
    flex = _flex_attention(query.is_cuda)
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _packed_inputs(model, packed: Packed, shard: Shard | None = None) -> dict:
    """The keywords of ``model``'s forward on ``packed``: the pack's ids and positions, its
    boundaries (flash-attention's varlen kernel reads them), and for :func:`packed_sdpa` the
    pack's grids or block mask, which send every attention call of the forward, and of its
    recomputation under gradient checkpointing, to it. With a ``shard`` (sequence parallelism),
    the shard's ids and positions, and the shard itself for the attention."""
    cu, longest = packed.cu_seqlens, packed.max_length
    if _on_flash(model):
        if shard is not None:
            raise ValueError(
                f"sequence_parallel needs attn_implementation 'sdpa' or 'eager' (the packed attention); model has "
                f"{model.config._attn_implementation!r}"
            )
        kernel = {}
    else:
        if model.config._attn_implementation not in _ORIGINALS:
            raise ValueError(
                f"model attends with {model.config._attn_implementation!r}, which would attend across the packed "
                "sequences; build it with grpo_fast.packing.use_packed_attention(model)"
            )
        # A ready 4D mask spares transformers the [S, S] block-diagonal mask it would build from
        # the restarting positions (packed_sdpa needs none). Empty, so that an attention other
        # than packed_sdpa fails on it rather than attend across sequences.
        kernel = {"attention_mask": torch.empty((1, 1, 0, 0), dtype=torch.bool, device=packed.input_ids.device)}
        if packed.attention == "flex":
            kernel["flex_block_mask"] = flex_block_mask(packed)
        else:
            kernel["packed_grids"] = packed.grids
        if shard is not None:
            kernel["sequence_shard"] = shard
    tokens = packed if shard is None else shard
    return dict(
        input_ids=tokens.input_ids,
        position_ids=tokens.position_ids,
        use_cache=False,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
        **kernel,
    )


def packed_logits(model, packed: Packed, shard: Shard | None = None) -> torch.Tensor:
    """The logits that predict the completion tokens: [1, Nc, V] (the LM head runs there only).
    ``model`` is flash-attention's or set by :func:`use_packed_attention`. With a ``shard``
    (``sequence_parallel.sequence_shard``): the model runs on the shard's tokens, and the logits are
    those of the shard's completion tokens, [1, n, V] in the order of ``shard.tokens``."""
    keep = packed.logit_index if shard is None else shard.logit_index
    return model(**_packed_inputs(model, packed, shard), logits_to_keep=keep).logits


def packed_hidden(model, packed: Packed, shard: Shard | None = None) -> torch.Tensor:
    """The last hidden states (after the final norm) that predict the completion tokens: [Nc, H]
    (with a ``shard``, its [n, H], as for :func:`packed_logits`). ``model`` as for
    :func:`packed_logits`."""
    hidden = model.get_decoder()(**_packed_inputs(model, packed, shard)).last_hidden_state
    return hidden[0, packed.logit_index if shard is None else shard.logit_index]
