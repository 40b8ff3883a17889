"""Test setup: Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the
top of the first module pytest loads. ``GRPO_FAST_TEST_CUDA=1`` keeps real CUDA kernels.
"""

import os

if os.environ.get("GRPO_FAST_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The padded batch's logits that predict the completion tokens, [N, C, V]: what the
    trainer's packed forwards are checked against. ``logits_to_keep`` runs the LM head on
    positions L-C-1 .. L-2 only (each predicts the next token)."""
    from grpo_fast.trainer.generators import position_ids

    L, C = input_ids.shape[1], num_completion_tokens
    keep = torch.arange(L - C - 1, L - 1, device=input_ids.device)
    positions = position_ids(attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=keep).logits


@torch.no_grad()
def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The completion tokens' log-probs under ``model`` from the padded batch: [N, C], no grad."""
    import grpo_fast

    C = num_completion_tokens
    return grpo_fast.token_logprobs(completion_logits(model, input_ids, attention_mask, C), input_ids[:, -C:])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num
