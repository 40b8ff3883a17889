"""The packed attention's dispatch (grpo_fast/packing/attention.py): a model is set to it once,
where it is built, and each attention call goes by its own keywords: a pack's grids to
``packed_sdpa``, anything else to the model's own attention. Nothing is switched per forward,
so a policy and a reference, two threads on one model, packed and not, and the recomputation
of gradient checkpointing each attend as they would alone.

The truths are transformers' own: the same weights on a model never set (SDPA, or eager),
padded rows with their attention mask; in float64 the packed values and gradients equal them
to 1e-10, and the unpacked ones are bit-identical.
"""

import copy
import threading
import types

import pytest
import torch
from _packed import C, rollout
from conftest import completion_logits, max_err, rel_err
from transformers import AttentionInterface, LlamaForCausalLM

import grpo_fast.packing.attention as packed_attention_module
from grpo_fast.packing import PACKED_ATTENTIONS, pack_micro_batches, packed_logits, to_grid, use_packed_attention
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

pytestmark = pytest.mark.usefixtures("float64_norms")  # Llama's norm in float64 (tests/_float64.py)
WAIT_S = 60  # a thread's longest wait for the other: a failure, never a hang


def demo_model(**overrides):
    """The demo model in float64 with grouped-query attention, as transformers builds it."""
    return build_model(build_tokenizer(), seed=3, num_key_value_heads=2, **overrides).double()


def padded_rows(group_size: int = 4):
    """A padded rollout [N, P + C] and the mask of its real completion tokens [N, C]."""
    input_ids, attention = rollout(group_size, [4, 1, 7])
    return input_ids, attention, attention[:, -C:].bool()


def packed_loss(model, packed, weights, real):
    """A weighted sum of the packed logits at the real completion tokens (weights [N, C, V])."""
    return (to_grid(packed_logits(model, packed), packed) * weights)[real].sum()


def padded_loss(model, input_ids, attention, weights, real):
    """The same sum from transformers' padded forward."""
    return (completion_logits(model, input_ids, attention, C) * weights)[real].sum()


def identical(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical, NaN where the other is (eager attention's rows of padding only)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def record(monkeypatch, calls: list, on_packed=None, on_own=None):
    """Appends ("packed" | "own", the model's attention implementation) to ``calls`` at each
    attention call, inside the registered function; ``on_packed`` / ``on_own`` run there too."""
    packed_sdpa, own_attention = packed_attention_module.packed_sdpa, packed_attention_module._own_attention

    def packed(module, *args, **kwargs):
        calls.append(("packed", module.config._attn_implementation))
        if on_packed is not None:
            on_packed()
        return packed_sdpa(module, *args, **kwargs)

    def own(module_type, original):
        attend = own_attention(module_type, original)

        def call(module, *args, **kwargs):
            calls.append(("own", module.config._attn_implementation))
            if on_own is not None:
                on_own()
            return attend(module, *args, **kwargs)

        return call

    monkeypatch.setattr(packed_attention_module, "packed_sdpa", packed)
    monkeypatch.setattr(packed_attention_module, "_own_attention", own)


@pytest.mark.parametrize("original", ["sdpa", "eager"])
def test_unpacked_calls_attend_as_the_models_own(original, tmp_path):
    """Set once (again: no change; a copy keeps it): the padded forward and greedy generation
    (a cache, masks at every step) are bit-identical to the model's own attention's, the packed
    logits equal SDPA's padded ones (eager's, in float64, are NaN after a row of padding: its
    additive mask overflows), and a saved folder does not carry the name."""
    plain = demo_model(attn_implementation=original)
    model = copy.deepcopy(plain)
    assert use_packed_attention(model) is model and use_packed_attention(model) is model
    name = PACKED_ATTENTIONS[original]
    assert model.config._attn_implementation == name and name in AttentionInterface()  # the public registry
    assert copy.deepcopy(model).config._attn_implementation == name and plain.config._attn_implementation == original
    input_ids, attention, real = padded_rows()
    with torch.no_grad():
        identical(completion_logits(model, input_ids, attention, C), completion_logits(plain, input_ids, attention, C))
        P = input_ids.shape[1] - C
        prompts = dict(input_ids=input_ids[:, :P], attention_mask=attention[:, :P], max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(**prompts), plain.generate(**prompts))
        (packed,) = pack_micro_batches(input_ids, attention, C, None, None, group_size=4)
        got = to_grid(packed_logits(model, packed), packed)[real]
        want = completion_logits(demo_model(), input_ids, attention, C)[real]  # SDPA's: eager's has NaN here
    assert rel_err(got, want) < 1e-10 and max_err(got, want) < 1e-10
    model.save_pretrained(tmp_path)
    assert "grpo_fast" not in (tmp_path / "config.json").read_text()


def test_what_cannot_attend_packed_says_so(monkeypatch):
    """A model never set, another attention implementation, or a model whose attention does not
    go through transformers' interface: a ValueError naming the fix. flash-attention is left as
    it is (its varlen kernel reads the pack's boundaries)."""
    input_ids, attention, _ = padded_rows()
    (packed,) = pack_micro_batches(input_ids, attention, C, None, None)
    with pytest.raises(ValueError, match=r"attends with 'sdpa', .*use_packed_attention\(model\)"):
        packed_logits(demo_model(), packed)
    other = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flex_attention"))
    with pytest.raises(
        ValueError, match="need attn_implementation 'sdpa', 'eager' or 'flash_attention_2'; model has 'flex_attention'"
    ):
        use_packed_attention(other)
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert use_packed_attention(flash) is flash and flash.config._attn_implementation == "flash_attention_2"
    with pytest.raises(ValueError, match="Linear's module has no eager_attention_forward to fall back to"):
        packed_attention_module._own_attention(torch.nn.Linear, "eager")  # an eager model's without its own
    monkeypatch.setattr(LlamaForCausalLM, "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.raises(
        ValueError, match=r"\(LlamaForCausalLM\) does not attend through transformers' AttentionInterface"
    ):
        use_packed_attention(demo_model())


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("group_size", [None, 4], ids=["whole-rows", "shared-prompts"])
def test_policy_and_reference_interleaved_under_gradient_checkpointing(monkeypatch, group_size, use_reentrant):
    """A checkpointed policy's packed forward, the reference's padded forward, the policy's
    backward (which recomputes every layer, packed: the replayed keywords carry the grids), the
    reference again: the policy's gradient equals transformers' padded one, the reference's
    logits its own, and inside every attention call, in the forward and in the recomputation,
    each model's attention implementation is what it was set to, before and after."""
    truth = demo_model()
    policy, reference = (use_packed_attention(copy.deepcopy(truth)) for _ in range(2))
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    reference_truth = copy.deepcopy(reference)
    name = PACKED_ATTENTIONS["sdpa"]
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    policy.train()
    input_ids, attention, real = padded_rows()
    (packed,) = pack_micro_batches(input_ids, attention, C, None, None, group_size=group_size)
    weights = torch.randn(*real.shape, truth.config.vocab_size, generator=torch.Generator().manual_seed(2)).double()
    padded_loss(truth, input_ids, attention, weights, real).backward()
    with torch.no_grad():
        reference_want = completion_logits(reference_truth, input_ids, attention, C)

    def reference_as_alone():
        with torch.no_grad():
            return torch.equal(completion_logits(reference, input_ids, attention, C), reference_want)

    calls = []
    record(monkeypatch, calls)
    loss = packed_loss(policy, packed, weights, real)
    assert reference_as_alone()
    loss.backward()
    assert reference_as_alone()
    layers = truth.config.num_hidden_layers
    # the policy's forward, the reference's, the policy's recomputation, the reference's
    assert calls == ([("packed", name)] * layers + [("own", name)] * layers) * 2
    assert policy.config._attn_implementation == reference.config._attn_implementation == name
    assert rel_err(grads(policy), grads(truth)) < 1e-10 and max_err(grads(policy), grads(truth)) < 1e-10


@pytest.mark.parametrize("waits", ["packed", "unpacked"])
def test_two_threads_on_one_model_packed_and_not(monkeypatch, waits):
    """A rollout thread's padded forward and greedy generation on the model that the main
    thread is packing, each run entirely inside the other's forward (the one that ``waits``
    stops in its first attention call until the other has finished): the packed logits and
    gradient, the padded logits and the generation are bit-identical to each run alone."""
    model = use_packed_attention(demo_model())
    input_ids, attention, real = padded_rows()
    (packed,) = pack_micro_batches(input_ids, attention, C, None, None, group_size=4)
    weights = torch.randn(*real.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(2)).double()
    P = input_ids.shape[1] - C
    prompts = dict(input_ids=input_ids[:, :P], attention_mask=attention[:, :P], max_new_tokens=4, do_sample=False)

    def packed_pass():
        model.zero_grad()
        packed_loss(model, packed, weights, real).backward()
        return grads(model)

    @torch.no_grad()
    def unpacked_pass():
        return completion_logits(model, input_ids, attention, C), model.generate(**prompts)

    alone = packed_pass(), unpacked_pass()
    inside, done, results = threading.Event(), threading.Event(), {}

    def stop_once():  # the waiting side's first attention call: the other runs whole meanwhile
        if not inside.is_set():
            inside.set()
            assert done.wait(WAIT_S), "the other thread did not finish"

    record(monkeypatch, [], **{"on_packed" if waits == "packed" else "on_own": stop_once})

    def run(key: str, work, waits_here: bool):
        try:
            if not waits_here:
                assert inside.wait(WAIT_S), "the other thread's forward did not start"
            results[key] = work()
        finally:
            if not waits_here:
                done.set()

    thread = threading.Thread(target=run, args=("unpacked", unpacked_pass, waits == "unpacked"))
    thread.start()
    run("packed", packed_pass, waits == "packed")
    thread.join(WAIT_S)
    assert not thread.is_alive() and inside.is_set()
    assert torch.equal(results["packed"], alone[0])
    assert all(torch.equal(a, b) for a, b in zip(results["unpacked"], alone[1]))
