"""checkpoint_every (grpo_fast/trainer/model/checkpoint_runs.py): gradient checkpointing that
keeps one decoder layer's input in N holds that many after the forward, and gives the gradient
that keeping every input gives, bit for bit: under torch's non-reentrant and reentrant
checkpoints, with dropout (the replay's random state), under bf16 autocast (the replay's
precision). With activation_offloading every run's first input but the last run's waits in host
memory (on CPU the same memory: the mechanics; on CUDA, in the GPU script, pinned memory and a
side stream), and the gradient is the same. tests/test_trainer.py checks it in the trainer
(packed attention, LoRA)."""

import copy

import pytest
import torch
from conftest import DEVICES

from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.model.checkpoint_runs import checkpoint_runs

LAYERS = 5  # runs of 2: [0 1] [2 3] [4]; of 3: [0 1 2] [3 4]


@pytest.fixture(scope="module")
def model():
    return build_model(build_tokenizer(), seed=4, num_hidden_layers=LAYERS, attention_dropout=0.2)


def gradient_and_kept(model, every, use_reentrant, dtype, autocast, offload=False, device="cpu"):
    """The gradient of a weighted sum of ``model``'s logits (a copy in ``dtype``, checkpointed,
    one input in ``every`` kept; every = 0: no checkpointing), and how many decoder-layer
    inputs held their storage between the forward and the backward."""
    model = copy.deepcopy(model).to(device, dtype).train()
    if every:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        checkpoint_runs(model, every, offload)
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0)).to(device)
    weights = torch.randn(3, 11, model.config.vocab_size, generator=torch.Generator().manual_seed(1), dtype=dtype)
    weights = weights.to(device)
    torch.manual_seed(5)  # the dropout's draws (CPU's and CUDA's)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids).logits
    forward = inputs[:LAYERS]  # the first forward's (a reentrant recompute appends its own)
    kept = sum(t.untyped_storage().nbytes() > 0 for t in forward)
    (logits.to(dtype) * weights).sum().backward()
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in forward)  # refilled
    return torch.cat([p.grad.flatten() for p in model.parameters()]).cpu(), kept


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_runs_keep_one_input_in_every_and_give_the_same_gradient(model, use_reentrant, device):
    # on CUDA float64 only: bf16 attention's backward may sum in another order run to run there
    # (atomics), so two runs need not be equal bit for bit; float64 takes SDPA's math path
    precisions = ((torch.float64, False),) if device == "cuda" else ((torch.float64, False), (torch.float32, True))
    for dtype, autocast in precisions:
        plain, _ = gradient_and_kept(model, 0, use_reentrant, dtype, autocast, device=device)
        truth, held = gradient_and_kept(model, 1, use_reentrant, dtype, autocast, device=device)  # every input kept
        assert held == LAYERS and plain.norm() > 0
        # recomputing sums the parameters' gradient terms in another order: float64's last bits
        assert (truth - plain).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-4) * plain.abs().max()
        for every, kept, offload in ((2, 3, False), (3, 2, False), (LAYERS, 1, False), (1, 1, True), (2, 1, True)):
            # offloaded: every run's first input is in host memory but the last run's (layer 4's)
            grad, held = gradient_and_kept(model, every, use_reentrant, dtype, autocast, offload, device)
            assert held == kept, (every, offload, held)
            assert torch.equal(grad, truth), (every, offload, dtype, (grad - truth).abs().max())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(checkpoint_every=0), "checkpoint_every must be an int >= 1, got 0"),
        (dict(checkpoint_every=2), "checkpoint_every=2 needs gradient_checkpointing=True"),
        (dict(activation_offloading=True), "activation_offloading=True needs gradient_checkpointing=True"),
    ],
)
def test_bad_checkpoint_every_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**options).validate()
