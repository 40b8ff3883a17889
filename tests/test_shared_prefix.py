"""Shared-prefix packing (``pack(..., groups=...)``): each group's prompt through the model
once per micro-batch, as ``[prompt | completion_1 | ... | completion_g]``.

The truth is today's pack, every row whole. In float64, the logits that predict the
completion tokens, the last hidden states there, and every parameter's gradient of a loss on
them equal it to 1e-10: prompts of several lengths, G of 1, 2 and 8, completions of one token
and of the maximum length, grouped-query attention, and micro-batches that split a group.
"""

import pytest
import torch
from _packed import C, a_call_per_length, assert_packed_equals_padded, float64_trainer, rollout
from conftest import completion_logits, max_err, rel_err

import grpo_fast.packing.attention as packed_attention_module
from grpo_fast.packing import (
    ATTENTIONS,
    pack,
    pack_by_prompt,
    pack_micro_batches,
    packed_hidden,
    packed_logits,
    to_grid,
    use_packed_attention,
)
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig
from grpo_fast.trainer.choices import ATTENTION_KERNELS
from grpo_fast.trainer.model.packing import shared_group_size

pytestmark = pytest.mark.usefixtures("float64_norms")  # Llama's norm in float64 (tests/_float64.py)


@pytest.fixture(scope="module")
def model():
    """The demo model in float64 with grouped-query attention, set to the packed attention."""
    return use_packed_attention(build_model(build_tokenizer(), seed=3, num_key_value_heads=2).double())


def test_shared_layout():
    """One prompt, then each completion with positions continuing from the prompt's length;
    the prompt's last token predicts every completion's first."""
    pad = 0
    input_ids = torch.tensor([[pad, 5, 6, 7, 8, pad], [pad, 5, 6, 9, pad, pad], [4, 3, 2, 1, 11, 12]])
    attention = (input_ids != pad).long()
    packed = pack(input_ids, attention, 3, slice(0, 3), groups=[0, 0, 1])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 1, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 4, 5]]
    assert packed.cu_seqlens.tolist() == [0, 5, 11] and packed.max_length == 6
    assert packed.targets.tolist() == [[7, 8, 9, 1, 11, 12]]
    assert packed.logit_index.tolist() == [1, 2, 1, 7, 8, 9]  # 9's predecessor is the prompt's 6
    whole = pack(input_ids, attention, 3, slice(0, 3))
    assert packed.targets.tolist() == whole.targets.tolist() and packed.grid[1].tolist() == whole.grid[1].tolist()
    prompts_only = pack(input_ids, (input_ids != pad).long() * (torch.arange(6) < 3), 3, slice(0, 3), groups=[0, 0, 1])
    assert prompts_only.prefix is None and prompts_only.targets.shape == (1, 0)  # nothing to share a prompt for
    with pytest.raises(ValueError, match="groups must hold one key per row of the slice \\(3\\), got 2"):
        pack(input_ids, attention, 3, slice(0, 3), groups=[0, 0])
    with pytest.raises(ValueError, match="rows \\[2, 3\\] of one group have prompts of different lengths"):
        pack(
            torch.cat([input_ids, input_ids[:1]]),
            torch.cat([attention, attention[:1]]),
            3,
            slice(0, 4),
            groups=[0, 0, 1, 1],
        )


def _values(model, packed, weights):
    """Logits and hidden states at the completion predictions, and the parameters' gradient of
    a weighted sum of both."""
    model.zero_grad()
    logits, hidden = packed_logits(model, packed)[0], packed_hidden(model, packed)
    ((logits * weights[0]).sum() + (hidden * weights[1]).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logits.detach(), hidden.detach(), grads


@pytest.mark.parametrize(
    "per_length", [False, True, "replayed"], ids=["few-calls", "a-call-per-length-kv-heads-repeated", "replayed"]
)
@pytest.mark.parametrize("group_size", [1, 2, 8])
def test_shared_prefix_equals_every_row_whole(model, group_size, per_length, monkeypatch):
    if per_length:  # an SDPA call per length (grids.attention_grids), kv heads repeated as on CUDA
        a_call_per_length(monkeypatch, replayed=per_length == "replayed")
        monkeypatch.setattr(packed_attention_module, "_kernels_take_gqa", lambda query: False)
    input_ids, attention = rollout(group_size, [4, 1, 7])
    N = input_ids.shape[0]
    split, calls = False, 0
    for max_tokens, max_rows in ((None, None), (23, None), (None, 3)):  # one pack, or packs that split groups
        whole = pack_micro_batches(input_ids, attention, C, max_tokens, max_rows)
        shared = pack_micro_batches(input_ids, attention, C, max_tokens, max_rows, group_size=group_size)
        assert [p.rows for p in whole] == [p.rows for p in shared]
        split |= any(p.rows.start % group_size for p in whole)
        for w, s in zip(whole, shared):
            saved = (w.input_ids.shape[1] - s.input_ids.shape[1]) / w.input_ids.shape[1]
            assert saved > 0 or group_size == 1 or s.rows.stop - s.rows.start == 1
            V, H = model.config.vocab_size, model.config.hidden_size
            g = torch.Generator().manual_seed(s.rows.start)
            weights = (torch.randn(1, w.targets.shape[1], V, generator=g).double(), None)
            weights = (weights[0], torch.randn(w.targets.shape[1], H, generator=g).double())
            want, got = _values(model, w, weights), _values(model, s, weights)
            for a, b in zip(got, want):
                assert rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10
            calls = max(calls, len(s.grids.calls))
            if per_length == "replayed":  # no call after a prompt keeps a mask
                assert all(call.key_mask is None for call in s.grids.calls)
    assert N == 3 * group_size and split == (group_size > 1)
    # one causal call (whole rows, or the prompts) and one after the prompts; or one per length
    # (replayed: the masks' cost moves the first-fit's merges of spans after prompts of two lengths)
    per_length_calls = {1: 3, 2: 9, 8: 17 if per_length == "replayed" else 18}
    assert calls == (per_length_calls[group_size] if per_length else 1 + (group_size > 1))


def test_flex_attention_equals_sdpa(model):
    """``attention="flex"``: one FlexAttention call with the pack's block mask, whole rows and
    shared prompts, equals SDPA on every row whole (float64, forward: FlexAttention has no CPU
    backward, so its gradients are checked on CUDA by benchmarks/gpu/bench_trainer_step.py;
    a CPU backward is refused by name)."""
    input_ids, attention = rollout(8, [4, 1, 7])
    whole = pack_micro_batches(input_ids, attention, C, None, None)[0]
    with torch.no_grad():
        want = packed_logits(model, whole), packed_hidden(model, whole)
        for group_size in (None, 8):
            flex = pack_micro_batches(input_ids, attention, C, None, 12, group_size, attention="flex")
            assert flex[0].attention == "flex" and (flex[0].prefix is None) == (group_size is None)
            got = [
                torch.cat(values, dim)
                for values, dim in zip(zip(*[(packed_logits(model, p), packed_hidden(model, p)) for p in flex]), (1, 0))
            ]
            for a, b in zip(got, want):
                assert rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10
    with pytest.raises(ValueError, match="attention='flex' trains on CUDA only"):
        packed_hidden(model, flex[0]).sum().backward()
    with pytest.raises(ValueError, match=r"attention must be one of \('sdpa', 'flex'\), got 'flash'"):
        pack(input_ids, attention, C, slice(0, 2), attention="flash")
    assert ATTENTION_KERNELS == ATTENTIONS  # the config validates the names before torch loads
    with pytest.raises(ValueError, match=r"attention_kernel must be one of \('sdpa', 'flex'\), got 'flash'"):
        GRPOConfig(attention_kernel="flash").validate()


@pytest.mark.parametrize("overrides", [{}, {"lora_r": 4}, {"fused_linear": True}], ids=["full", "lora", "fused_linear"])
def test_a_shared_prefix_step_equals_the_padded_step(tmp_path, overrides):
    """The trainer with ``shared_prefix``: its reference log-probs, loss and gradients (two
    passes, old log-probs off-policy, a KL term, a token budget that splits groups) equal the
    padded computation's, as the unshared step's do (tests/test_packing.py)."""
    trainer = float64_trainer(tmp_path, shared_prefix=True, **overrides)
    if "lora_r" in overrides:
        with torch.no_grad():
            for name, p in trainer.policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    else:
        with torch.no_grad():
            for p in trainer.reference.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    batch = trainer.prepare(trainer.source.next(trainer.data_position, trainer.version))
    G = trainer.config.group_size
    # a micro-batch whose rows are each alone of their group's (a token budget's cut) packs them whole
    units = [(p.prefix is not None, p.cu_seqlens.numel() - 1 < p.rows.stop - p.rows.start) for p in batch.micro_batches]
    assert all(shared == fewer for shared, fewer in units) and any(shared for shared, _ in units), units
    assert any(p.rows.start % G for p in batch.micro_batches)  # a group split across micro-batches
    out = assert_packed_equals_padded(trainer)
    assert out.kl > 0 or "lora_r" in overrides
    metrics, batch = trainer.run_step()  # the log line counts what the body ran
    forward = sum(p.input_ids.shape[1] for p in batch.micro_batches)
    tokens = batch.samples.attention_mask.sum().item()
    assert metrics["forward_tokens"] == forward < tokens
    assert metrics["prefix_saved"] == pytest.approx(1 - forward / tokens)


def _grid_values(model, packed, weights):
    """The last hidden states on the rows' [N, C, H] grid and the parameters' gradient of a
    weighted sum of them."""
    model.zero_grad()
    hidden = to_grid(packed_hidden(model, packed).unsqueeze(0), packed)
    (hidden * weights).sum().backward()
    return hidden.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("padded_positions", [False, True], ids=["real-positions", "padded-positions"])
def test_equal_prompts_share_wherever_they_are(model, padded_positions):
    """A shuffled batch (TRL's micro-batches): ``pack_by_prompt`` packs its rows with equal
    prompts as one unit each and maps the values back to the given rows; equal to every row
    whole in float64, with positions counted either way (TRL's padded forward counts the
    padded columns)."""
    input_ids, attention = rollout(3, [4, 1, 7])
    order = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    ids, mask = input_ids[order], attention[order]
    whole = pack(ids, mask, C, slice(0, 9), padded_positions=padded_positions)
    shared = pack_by_prompt(ids, mask, C, padded_positions=padded_positions)
    assert shared.prefix is not None and shared.cu_seqlens.numel() == 4  # three prompts, each once
    assert shared.input_ids.shape[1] == whole.input_ids.shape[1] - 2 * (4 + 1 + 7)
    weights = torch.randn(9, C, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).double()
    for a, b in zip(_grid_values(model, shared, weights), _grid_values(model, whole, weights)):
        assert rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10
    if padded_positions:  # a left-padded prompt's tokens sit at their columns
        assert whole.position_ids[0, : int(mask[0].sum())].tolist() == mask[0].nonzero().squeeze(1).tolist()
    distinct = pack_by_prompt(ids[[0]], mask[[0]], C)
    assert distinct.prefix is None  # no prompt repeats: every row whole


def test_models_that_cannot_take_the_layout_pack_every_row_whole(caplog):
    """A model on flash-attention (its varlen kernel would let completions see each other) or
    with attention logit softcapping keeps today's pack, said once per reason; sliding-window
    layers take the shared layout (tests/test_real_models.py checks them)."""
    import types

    config = types.SimpleNamespace(shared_prefix=True, group_size=4)
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    from grpo_fast.packing import attention

    attention._whole_rows_for.cache_clear()  # said once per process: count from here
    with caplog.at_level("INFO", logger="grpo_fast"):
        assert shared_group_size(config, model) is None and shared_group_size(config, model) is None
        other = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa"))
        other.config.attn_logit_softcapping = 50.0
        assert shared_group_size(config, other) is None
        other.config = types.SimpleNamespace(_attn_implementation="sdpa", layer_types=["sliding_attention"])
        assert shared_group_size(config, other) == 4
    assert not hasattr(model.config, "_grpo_fast_no_shared_prefix")  # nothing written onto the model's config
    said = [r.message for r in caplog.records if "cannot take the shared layout" in r.message]
    assert len(said) == 2 and "flash_attention_2" in said[0] and "softcapping" in said[1], said
    model.config._attn_implementation = "sdpa"
    assert shared_group_size(config, model) == 4
    assert shared_group_size(types.SimpleNamespace(shared_prefix=False, group_size=4), model) is None
    ids = torch.tensor([[1, 2, 3], [1, 4, 3]])
    with pytest.raises(ValueError, match="group_size must be a positive int or None, got 0"):
        pack_micro_batches(ids, torch.ones_like(ids), 1, None, None, group_size=0)
    # a group whose rows have other prompts (a custom rollout source's) packs runs of equal prompts
    ids = torch.tensor([[1, 2, 3], [1, 4, 3], [1, 4, 5], [7, 2, 3]])
    (packed,) = pack_micro_batches(ids, torch.ones_like(ids), 1, None, None, group_size=4)
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 10] and packed.input_ids.tolist() == [[1, 2, 3, 1, 4, 3, 5, 7, 2, 3]]
    (whole,) = pack_micro_batches(ids[[0, 2]], torch.ones_like(ids[[0, 2]]), 1, None, None, group_size=2)
    assert whole.prefix is None  # no prompt shared: every row whole


@pytest.mark.parametrize("per_length", [False, True, "replayed"], ids=["few-calls", "a-call-per-length", "replayed"])
def test_sliding_windows_in_the_packed_layouts(per_length, monkeypatch):
    """Gemma 3's layers (a sliding window of 4 positions on 3 of 4 layers, one of 1 query and
    2 kv heads, a scaled embedding) in float64: whole rows and shared prompts equal the padded
    forward, whose mask transformers builds, to 1e-10 in logits, hidden states and every
    gradient; with the window ignored they would not (a prompt of 7 and completions of 5
    reach past it)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if per_length:
        a_call_per_length(monkeypatch, replayed=per_length == "replayed")
    layers = ["sliding_attention"] * 3 + ["full_attention"]
    config = Gemma3TextConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4, layer_types=layers, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(5)
    gemma = Gemma3ForCausalLM(config).double()
    input_ids, attention = rollout(4, [4, 1, 7])
    padded = completion_logits(gemma, input_ids, attention, C)  # [N, C, V], transformers' own masks
    use_packed_attention(gemma)
    (whole,) = pack_micro_batches(input_ids, attention, C, None, None)
    (shared,) = pack_micro_batches(input_ids, attention, C, None, None, group_size=4)
    g = torch.Generator().manual_seed(0)
    V, H = config.vocab_size, config.hidden_size
    weights = (torch.randn(1, whole.targets.shape[1], V, generator=g).double(),)
    weights += (torch.randn(whole.targets.shape[1], H, generator=g).double(),)
    want = _values(gemma, whole, weights)
    grid = to_grid(want[0][None], whole)  # [N, C, V], zero past each completion
    real = attention[:, -C:].bool()
    assert rel_err(grid[real], padded[real]) < 1e-10 and max_err(grid[real], padded[real]) < 1e-10
    for a, b in zip(_values(gemma, shared, weights), want):
        assert rel_err(a, b) < 1e-10 and max_err(a, b) < 1e-10
    assert (per_length == "replayed") == all(call.key_mask is None for call in shared.grids.calls)
    gemma.config.sliding_window = 64  # the same weights without a window that bites
    for layer in gemma.model.layers:
        layer.self_attn.sliding_window = 64 if layer.self_attn.sliding_window else None
    with torch.no_grad():
        unwindowed = packed_logits(gemma, whole)[0]  # [Nc, V]
    assert max_err(unwindowed, want[0]) > 1e-3
