"""mlp_tile_tokens (grpo_fast/trainer/model/mlp_tiles.py): each decoder layer's MLP runs in tiles
of T positions, forward and backward, and gives the untiled gradient (float64: to 1e-12; bf16
autocast: as the same tiles kept by autograd), with and without checkpointing (reentrant, non-reentrant, with
checkpoint runs), with LoRA on the MLP; no MLP call ever sees more than T positions, and nothing
it saves for the backward is wider than its input; a deep copy (the reference) runs its own
weights. tests/test_trainer.py and tests/test_distributed.py check it in the trainer (packed
rows, DDP, FSDP2, Ulysses)."""

import copy

import pytest
import torch
from conftest import DEVICES
from transformers.models.llama.modeling_llama import LlamaMLP

from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.model import mlp_tiles as tiles_module
from grpo_fast.trainer.model.checkpoint_runs import checkpoint_runs
from grpo_fast.trainer.model.mlp_tiles import mlp_tiles

T, ROWS, POSITIONS = 4, 2, 11  # 11 positions: tiles of 4, 4 and 3


@pytest.fixture(scope="module")
def model():
    return build_model(build_tokenizer(), seed=7, num_hidden_layers=3)


class DropoutMLP(LlamaMLP):
    """Llama's MLP with dropout on its output: the tiles' recompute must replay the draws."""

    def forward(self, x):
        return torch.nn.functional.dropout(super().forward(x), 0.3, self.training)


def run(
    model,
    tokens,
    dtype=torch.float64,
    autocast=False,
    checkpointing=None,
    every=1,
    lora=False,
    dropout=False,
    device="cpu",
):
    """A copy of ``model`` (MLPs in tiles of ``tokens``; 0: whole), its logits' weighted sum's
    gradient over the trainable parameters, the positions and dtype each MLP call saw (its down
    projection's input), and the widest tensor
    (last dim) the MLPs saved for backward outside the checkpoint."""
    model = copy.deepcopy(model).to(device, dtype).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        target = ["gate_proj", "up_proj", "down_proj", "q_proj"]
        torch.manual_seed(2)  # the adapters' initial values, B non-zero too (init_lora_weights=False)
        lora = LoraConfig(r=2, lora_alpha=4, target_modules=target, lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(model, lora)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        checkpoint_runs(model, every)
    mlp_tiles(model, tokens)
    base = model.get_base_model() if lora else model
    seen, widest, inside = [], [], []
    for layer in base.model.layers:
        if dropout:
            layer.mlp.__class__ = DropoutMLP
        layer.mlp.down_proj.register_forward_pre_hook(lambda _, args: seen.append((args[0].shape[-2], args[0].dtype)))
        layer.mlp.register_forward_pre_hook(lambda *_: inside.append(True))
        layer.mlp.register_forward_hook(lambda *_: inside.clear())

    def pack(t):  # the last dim of what an MLP saves for backward
        if inside:
            widest.append(t.shape[-1])
        return t

    ids = torch.randint(3, base.config.vocab_size, (ROWS, POSITIONS), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(ROWS, POSITIONS, base.config.vocab_size, generator=torch.Generator().manual_seed(1))
    ids, weights = ids.to(device), weights.to(device)
    torch.manual_seed(3)  # the dropout's draws
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
    (logits.to(dtype) * weights.to(dtype)).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).cpu()
    return grad, seen, max(widest, default=0)


@pytest.mark.parametrize("device", DEVICES)
def test_tiles_give_the_untiled_gradient_and_hold_one_tile(model, device):
    intermediate = model.config.intermediate_size
    truth, seen, widest = run(model, 0, device=device)
    assert max(seen)[0] == POSITIONS and widest == intermediate  # untiled: the MLPs save [.., 11, I]
    grad, seen, widest = run(model, T, device=device)
    assert torch.allclose(grad, truth, rtol=0, atol=1e-12 * truth.abs().max()) and truth.norm() > 0
    # forward 3 tiles a layer, backward 3 recomputed: no call on more than a tile, and only inputs saved
    assert [n for n, _ in seen] == [4, 4, 3] * 6 and widest < intermediate
    for checkpointing, every in ((False, 1), (True, 1), (False, 3)):  # non-reentrant, reentrant; with runs
        grad, seen, _ = run(model, T, checkpointing=checkpointing, every=every, device=device)
        assert torch.allclose(grad, truth, rtol=0, atol=1e-12 * truth.abs().max()), (checkpointing, every)
        assert max(seen)[0] == T


def test_tiles_with_lora_on_the_mlp_and_a_deep_copy(model):
    truth, _, _ = run(model, 0, lora=True, checkpointing=False)
    grad, seen, _ = run(model, T, lora=True, checkpointing=False)
    assert torch.allclose(grad, truth, rtol=0, atol=1e-12 * truth.abs().max()) and max(seen)[0] == T
    # a deep copy (the trainer's reference) runs its own weights, not the original's
    tiled = copy.deepcopy(model)
    mlp_tiles(tiled, T)
    twin = copy.deepcopy(tiled)
    for layer in twin.model.layers:
        layer.mlp.down_proj.weight.data.zero_()
    ids = torch.arange(3, 3 + POSITIONS)[None]
    with torch.no_grad():
        zeroed = copy.deepcopy(model)
        for layer in zeroed.model.layers:
            layer.mlp.down_proj.weight.data.zero_()
        assert torch.allclose(twin(ids).logits, zeroed(ids).logits, atol=1e-6)
        assert torch.allclose(tiled(ids).logits, model(ids).logits, atol=1e-6)


def test_the_backward_replays_the_forwards_random_draws_and_autocast(model, monkeypatch):
    """The recomputed tiles run as the forward's tiles ran: under bf16 autocast they compute in
    bf16 (the untiled gradient to bf16's precision), and with dropout in the MLP they draw what
    those drew: the gradient is that of the same tiles kept whole by autograd (the function
    bypassed)."""
    truth, _, _ = run(model, 0, dtype=torch.float32, autocast=True)
    grad, seen, _ = run(model, T, dtype=torch.float32, autocast=True)
    assert {dtype for _, dtype in seen} == {torch.bfloat16} and len(seen) == 18  # the recompute's too
    assert (grad - truth).norm() <= 1e-2 * truth.norm()
    grad, _, _ = run(model, T, dropout=True)
    bypass = lambda forward, tokens, x, *_: tiles_module._tiles(forward, x, tokens)  # noqa: E731
    monkeypatch.setattr(tiles_module._TiledMLP, "apply", bypass)
    truth, seen, _ = run(model, T, dropout=True)
    assert len(seen) == 9  # bypassed: no recompute
    assert torch.allclose(grad, truth, rtol=0, atol=1e-12 * truth.abs().max()) and truth.norm() > 0


@pytest.mark.parametrize(
    "value, message",
    [(-1, "mlp_tile_tokens must be an int >= 0, got -1"), (True, "mlp_tile_tokens must be an int >= 0, got True")],
)
def test_bad_mlp_tile_tokens_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(mlp_tile_tokens=value).validate()
