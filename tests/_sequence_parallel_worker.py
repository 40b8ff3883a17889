"""Helpers of tests/test_sequence_parallel.py, at any sequence-parallel degree.

As a script under torchrun (``torchrun --standalone --nproc-per-node 2 _sequence_parallel_worker.py
OUT``) its ranks form one sequence-parallel group, run every case of :func:`cases` on their
shards, and rank 0 saves the results to OUT; the test computes the cases on one rank, in its own
process, with the same functions (:func:`run_case` without a group).
"""

import sys

import torch
import torch.distributed as dist
from _float64 import patch_llama_norms
from _packed import rollout
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_fast import token_logprobs
from grpo_fast.packing import (
    gather_tokens,
    pack_micro_batches,
    packed_logits,
    sequence_shard,
    ulysses_all_to_all,
    use_packed_attention,
)

C = 5  # the completions' columns of _packed.rollout


def tiny_llama(heads: int = 4, kv_heads: int = 2, hidden: int = 64):
    """A float64 2-layer Llama with grouped-query attention, set to the packed attention."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="sdpa",
    )
    return use_packed_attention(LlamaForCausalLM(config).double())


def cases() -> dict:
    """name -> one pack: whole rows, and shared prefixes (groups of 4 rows) whose middle
    group straddles the boundary of two ranks' shards (the test checks it does)."""
    input_ids, attention = rollout(4, [4, 1, 7], seed=2)
    whole = pack_micro_batches(input_ids, attention, C, None, None)
    shared = pack_micro_batches(input_ids, attention, C, None, None, group_size=4)
    return {"whole": whole[0], "shared": shared[0]}


def run_case(model, packed, group=None) -> dict:
    """The logits [Nc, V] and log-probs [Nc] of ``packed``'s completion tokens and the
    parameters' gradients of a loss that reads both, on one rank (``group`` None) or
    sequence-parallel over ``group`` (the gradients summed over it: each rank holds its
    tokens' share)."""
    model.zero_grad()
    part = None if group is None else sequence_shard(packed, group)
    logits = packed_logits(model, packed, part)[0]  # [Nc or n, V]
    targets = packed.targets[0] if part is None else packed.targets[0, part.tokens]
    logp = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0))[0]
    if part is not None:
        logits, logp = gather_tokens(logits, part), gather_tokens(logp, part)
    weights = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype)
    (logp * weights).sum().add(logits.square().mean()).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if group is not None:
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
    return dict(logits=logits.detach(), logprobs=logp.detach(), grads=grads)


def exchange_check(group) -> dict:
    """:func:`ulysses_all_to_all` of [1, 4, 3, 2] (heads for tokens) against the rearrangement it must
    be, and its backward: the exchange only moves values, so the gradient of ``y . y`` taken
    back through it is each rank's own 2x."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def x_of(r):  # rank r's [1, H, T, d]
        return torch.arange(24, dtype=torch.float64).view(1, 4, 3, 2) + 100 * r

    x = x_of(rank).requires_grad_()
    y = ulysses_all_to_all(x, group, 1, 2)
    heads = 4 // size
    expected = torch.cat([x_of(r)[:, rank * heads : (rank + 1) * heads] for r in range(size)], 2)
    y.square().sum().backward()
    back = ulysses_all_to_all(y.detach(), group, 2, 1)
    return dict(
        forward=torch.equal(y, expected), backward=torch.equal(x.grad, 2 * x_of(rank)), inverse=torch.equal(back, x)
    )


def main(out: str) -> None:
    patch_llama_norms()
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    model = tiny_llama()
    results = {name: run_case(model, packed, group) for name, packed in cases().items()}
    results["exchange"] = exchange_check(group)
    try:
        run_case(tiny_llama(heads=3, kv_heads=3, hidden=48), cases()["whole"], group)
    except ValueError as error:
        results["heads_error"] = str(error)
    results["mqa"] = run_case(tiny_llama(kv_heads=1), cases()["shared"], group)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
