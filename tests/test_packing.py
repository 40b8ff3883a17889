"""Padding-free training (grpo_fast/packing/): packed and padded steps agree.

The truth is the padded computation the trainer used before packing: the model on the
left-padded [N, P + C] batch with its attention mask, logits at the completion positions,
``grpo_loss`` on the [N, C] grid. In float64, for every loss type, with a frozen reference
copy and with a LoRA policy (reference = adapters off), the packed step's loss, metrics and
gradients equal it to rounding: each group's prompt once (the default), and every row whole.
"""

import pytest
import torch
from _packed import C, a_call_per_length, assert_packed_equals_padded, float64_trainer, rollout
from conftest import rel_err

import grpo_fast.packing.attention as packed_attention_module
from grpo_fast.packing import layout as layout_module
from grpo_fast.packing import (
    micro_batches,
    pack,
    pack_micro_batches,
    packed_logits,
    packed_sdpa,
    to_grid,
    use_packed_attention,
)
from grpo_fast.packing.cost import HOST_COSTS, LayerShape, PackCost
from grpo_fast.packing.grids import attention_grids
from grpo_fast.spec import LOSS_TYPES
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer.runtime import Runtime

pytestmark = pytest.mark.usefixtures("float64_norms")  # Llama's norm in float64 (tests/_float64.py)
CASES = [dict(loss_type=name) for name in LOSS_TYPES] + [dict(loss_type="grpo", importance_sampling="sequence")]


def case_id(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_packed_step_equals_padded_step(tmp_path, case):
    """Frozen reference copy (moved off the policy so that the KL term is live); micro-batches
    by a token budget; float64."""
    trainer = float64_trainer(tmp_path, **case)
    with torch.no_grad():
        for p in trainer.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    out = assert_packed_equals_padded(trainer)
    assert out.kl > 0 and (out.clip_ratio_region > 0 or case["loss_type"] == "cispo")  # cispo caps at 5


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=case_id)
def test_packed_step_equals_padded_step_with_lora(tmp_path, case):
    """A LoRA policy whose reference is itself with adapters off, adapters made non-zero."""
    trainer = float64_trainer(tmp_path, lora_r=4, **case)
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    assert trainer.reference is trainer.policy
    assert_packed_equals_padded(trainer)


def test_fused_linear_packed_equals_padded(tmp_path):
    trainer = float64_trainer(tmp_path, fused_linear=True, shared_prefix=False)
    assert_packed_equals_padded(trainer)
    metrics, batch = trainer.run_step()  # every row whole: the body runs every real token
    assert metrics["forward_tokens"] == batch.samples.attention_mask.sum().item() and metrics["prefix_saved"] == 0


def test_pack_layout():
    """Left-padded prompts and right-padded completions become one row of real tokens, with
    positions restarting per sequence and the completion tokens' grid places."""
    pad = 0
    input_ids = torch.tensor([[pad, 5, 6, 7, 8, pad], [9, 10, 11, 12, 13, 14], [pad, pad, 4, 3, pad, pad]])
    attention = (input_ids != pad).long()
    packed = pack(input_ids, attention, 3, slice(0, 3))
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 4, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 4, 10, 12] and packed.max_length == 6
    assert packed.targets.tolist() == [[7, 8, 12, 13, 14, 3]]
    assert packed.logit_index.tolist() == [1, 2, 6, 7, 8, 10]  # each target's predecessor
    grid = to_grid(packed.targets, packed)
    assert grid.tolist() == [[7, 8, 0], [12, 13, 14], [3, 0, 0]]
    middle = pack(input_ids, attention, 3, slice(1, 2))
    assert middle.input_ids.tolist() == [[9, 10, 11, 12, 13, 14]] and middle.grid_shape == (1, 3)
    with pytest.raises(ValueError, match="at least one prompt token"):
        pack(torch.tensor([[pad, pad, 4]]), torch.tensor([[0, 0, 1]]), 1, slice(0, 1))


@pytest.mark.parametrize(
    "per_length, kv_heads_in_kernel",
    [(False, True), (True, True), (True, False)],
    ids=["one-call", "a-call-per-length", "kv-heads-repeated"],
)
def test_packed_logits_equal_each_sequence_alone(monkeypatch, per_length, kv_heads_in_kernel):
    """Attention stays within each packed sequence: the packed logits equal those of each
    sequence run alone (grouped-query attention, sequences of different lengths), on one grid
    or on a grid per length, the key and value heads passed to SDPA as they are (CPU) or
    repeated to the query heads (CUDA's way, here on CPU); without the pack's grids,
    packed_sdpa attends the sequences of ``cu_seq_lens_q`` the same."""
    if per_length:
        a_call_per_length(monkeypatch)
    monkeypatch.setattr(packed_attention_module, "_kernels_take_gqa", lambda query: kv_heads_in_kernel)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=4, num_key_value_heads=1).double()
    input_ids = torch.randint(3, 15, (4, 9), generator=torch.Generator().manual_seed(0))
    lengths = [9, 3, 6, 2]
    attention = (torch.arange(9) >= 9 - torch.tensor(lengths).unsqueeze(1)).long()  # left-padded
    packed = pack(input_ids, attention, 1, slice(0, 4))
    assert len(packed.grids.calls) == (4 if per_length else 1)
    with torch.no_grad():  # transformers' own attention, before the model is set to the packed one
        alone = [model(input_ids=input_ids[b : b + 1, 9 - n :]).logits[0, -2] for b, n in enumerate(lengths)]
    logits = to_grid(packed_logits(use_packed_attention(model), packed), packed)  # [4, 1, V]: the last predictions
    for b in range(len(lengths)):
        assert rel_err(logits[b, 0], alone[b]) < 1e-12
    q, k = torch.randn(1, 4, 20, 8, dtype=torch.float64), torch.randn(1, 2, 20, 8, dtype=torch.float64)
    by_grids = packed_sdpa(None, q, k, k, None, packed_grids=packed.grids)[0]
    assert torch.equal(packed_sdpa(None, q, k, k, None, cu_seq_lens_q=packed.cu_seqlens)[0], by_grids)
    with pytest.raises(ValueError, match="packed_sdpa needs the pack's packed_grids, or cu_seq_lens_q"):
        packed_sdpa(None, q, k, k, None)


def test_attention_grids_hold_each_token_once_and_merge_only_where_it_pays(monkeypatch):
    """Each packed token has one slot, where its grid reads it back; causal spans and spans
    after a prefix never share a call; a call that holds several spans is predicted to cost no
    more than a call for each (the first-fit merges only where that holds); an empty span has no
    slot. With no fixed cost to a call, unlike lengths each get one; at CUDA's costs, calls
    merge into one per kind."""
    spans = [(0, 30, 0, 0), (30, 3, 0, 30), (33, 40, 0, 30), (73, 0, 0, 30), (73, 28, 0, 0), (101, 2, 0, 0)]
    spans += [(103, 9, 101, 2), (112, 1, 101, 2), (113, 8, 101, 2)]
    S, fitted = 121, HOST_COSTS["cpu"]
    for host in (fitted._replace(call=0.0, row=0.0), fitted._replace(call=fitted.call / 4), fitted):
        monkeypatch.setitem(HOST_COSTS, "cpu", host)
        cost = PackCost.reference("cpu")
        grids = attention_grids(spans, S, "cpu")
        assert grids.query_reads[grids.slots].tolist() == list(range(S)) and len(set(grids.slots.tolist())) == S
        calls = grids.calls
        query_reads = grids.query_reads.split([call.rows * call.queries for call in calls])
        key_reads = grids.key_reads.split([call.rows * call.keys for call in calls])
        for call, reads, keys in zip(calls, query_reads, key_reads):
            starts = reads.view(call.rows, -1)[:, 0].tolist()
            members = [span for span in spans if span[0] in starts and span[1] > 0]
            assert len(members) == call.rows and len({span[3] > 0 for span in members}) == 1
            prefix = max(span[3] for span in members)
            alone = sum(cost.call_seconds(1, length, p + length, p > 0) for _, length, _, p in members)
            assert cost.call_seconds(call.rows, call.queries, call.keys, prefix > 0) <= alone * (1 + 1e-12)
            assert call.keys == prefix + call.queries and (call.key_mask is None) == (prefix == 0)
            if prefix:  # keys: the prefix padded to its longest, then the span, and which of them a query sees
                aligned = all(span[3] == prefix for span in members)  # one mask serves every row
                assert call.key_mask.shape == (1 if aligned else call.rows, 1, call.queries, call.keys)
                assert torch.equal(keys.view(call.rows, -1)[:, prefix:], reads.view(call.rows, -1))
            else:
                assert torch.equal(keys, reads)
        if host.call == 0:  # every span of its own length alone: 30, 28, 2; 40, 3, 9, 8, 1
            assert len(grids.calls) == 8
    monkeypatch.setitem(HOST_COSTS, "cpu", HOST_COSTS["cuda"])  # a GPU's: a call is worth far more work
    assert len(attention_grids(spans, S, "cpu").calls) == 2
    # Where a mask costs more than the prefix's pairs, a call of spans after prefixes of its
    # width runs causal rows of [prefix | span], the prefix's outputs dropped (the slots skip
    # them); spans after prefixes of other widths keep their mask.
    monkeypatch.setitem(HOST_COSTS, "cpu", fitted._replace(call=0.0, row=0.0, masked=100 * fitted.causal))
    grids = attention_grids(spans, S, "cpu")
    assert grids.query_reads[grids.slots].tolist() == list(range(S))
    offsets = [0]
    for call in grids.calls:
        offsets.append(offsets[-1] + call.rows * call.queries)
    replayed = 0
    for start, length, prefix_start, prefix in spans:
        if not (length and prefix):
            continue
        first = int(grids.slots[start])
        index = max(i for i, offset in enumerate(offsets[:-1]) if offset <= first)
        call = grids.calls[index]
        row, column = divmod(first - offsets[index], call.queries)
        if call.key_mask is None:  # the row reads its prefix, then the span; the span's slots follow the prefix
            replayed += 1
            reads = grids.query_reads[offsets[index] :][row * call.queries :][: prefix + length]
            assert column == prefix and reads.tolist() == [
                *range(prefix_start, prefix_start + prefix),
                *range(start, start + length),
            ]
    assert replayed == 5  # after the prefix of 30: 3 and 40 tokens; after that of 2: 9, 1 and 8
    with pytest.raises(ValueError, match="spans must hold each of the 122 packed tokens once"):
        attention_grids(spans, S + 1, "cpu")


def test_a_micro_batch_packs_whole_rows_where_sharing_is_predicted_not_to_pay(caplog):
    """With the host's costs the groups share their prompts; where dense layers cost nothing
    and a masked call twice a causal one, sharing cannot pay, and the micro-batch packs whole
    rows, exactly as without groups, said once in the log. The layer's shape is read from the
    config (grouped-query heads, a head size of its own, a multimodal config's text part)."""
    from transformers import Gemma3Config, LlamaConfig

    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    shape = LayerShape.of(llama)
    assert shape == LayerShape(flops=2 * (64 * (2 * 32 + 2 * 16) + 3 * 64 * 128), width=32, kv_width=16)
    assert LayerShape.of(Gemma3Config(text_config=llama.to_dict())) == shape
    input_ids, attention = rollout(4, [6, 2, 9])
    fitted = HOST_COSTS["cpu"]
    no_gain = PackCost(fitted._replace(flop=0.0, masked=2 * fitted.causal), shape)
    layout_module._say_whole_rows.cache_clear()
    with caplog.at_level("INFO", logger="grpo_fast"):
        [shared] = pack_micro_batches(input_ids, attention, C, None, None, 4, cost=PackCost(fitted, shape))
        whole = [pack_micro_batches(input_ids, attention, C, None, 2, 4, cost=no_gain) for _ in range(2)][0]
    assert shared.prefix is not None and shared.input_ids.shape[1] < int(attention.sum())
    for packed, plain in zip(whole, pack_micro_batches(input_ids, attention, C, None, 2)):
        assert packed.prefix is None and torch.equal(packed.input_ids, plain.input_ids)
        assert torch.equal(packed.logit_index, plain.logit_index) and len(packed.grids.calls) >= 1
    assert [r.getMessage() for r in caplog.records].count(caplog.records[-1].getMessage()) == 1
    assert "packing whole rows" in caplog.records[-1].getMessage()


def test_micro_batches_follow_the_token_budget():
    lengths = [5, 7, 3, 20, 2, 2, 9]
    slices = micro_batches(lengths, 12, None)
    assert [(s.start, s.stop) for s in slices] == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    for s in slices:  # within budget, or a single row longer than it
        assert sum(lengths[s]) <= 12 or s.stop - s.start == 1
    assert [(s.start, s.stop) for s in micro_batches(lengths, None, 3)] == [(0, 3), (3, 6), (6, 7)]
    assert [(s.start, s.stop) for s in micro_batches(lengths, 12, 1)] == [(i, i + 1) for i in range(7)]
    assert micro_batches(lengths, None, None) == [slice(0, 7)]


def test_flash_attention_only_on_cuda_in_bf16_with_flash_attn(monkeypatch):
    """The trainer loads --model with flash_attention_2 (varlen kernels for packed rows) only
    where it can run: CUDA, bf16 autocast, flash-attn installed."""
    import transformers.utils

    def runtime(device, bf16):  # no process group: a device and a precision are all it holds here
        return Runtime(torch.device(device), ranks=object(), bf16=bf16)

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert runtime("cuda", True).flash_attention()
    assert not runtime("cuda", False).flash_attention() and not runtime("cpu", True).flash_attention()
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert not runtime("cuda", True).flash_attention()
