"""Ulysses sequence parallelism (grpo_fast/packing/sequence_parallel.py): two gloo ranks share
one packed row and give one rank's logits, log-probs and every parameter gradient, in float64
to 1e-10, for whole rows and for a shared-prefix pack whose group straddles the ranks' shards;
grouped-query heads (2 key/value heads of 4) and one key/value head (repeated) alike. The
exchange moves values exactly and is its own backward's inverse; a model whose heads do not
divide by the degree is refused with an error that names ``sequence_parallel``, and so is a
degree that is no positive int or does not divide the world size. The trainer's passes under
``--sequence-parallel 2`` are checked against one process in tests/test_distributed.py.
"""

import json
import os
import sys
import types

import _sequence_parallel_worker as worker
import pytest
import torch
from conftest import TESTS, assert_rows_close, max_err, run_child, start_child, torchrun_command

from grpo_fast.cli import build_parser, dashed, make_config
from grpo_fast.packing import pack, sequence_shard
from grpo_fast.spec import LossConfig
from grpo_fast.trainer import GRPOConfig
from grpo_fast.trainer.distributed import Ranks, sequence_layout
from grpo_fast.trainer.model.packed_policy import PackedPolicy


def straddles(packed, ranks: int) -> bool:
    """Whether a unit (a row, or a group's prompt and completions) of ``packed`` holds tokens on
    both sides of a boundary between two ranks' shards."""
    length = -(-packed.input_ids.shape[1] // ranks)
    cu = packed.cu_seqlens.tolist()
    return any(start < b < end for start, end in zip(cu, cu[1:]) for b in range(length, cu[-1], length))


def assert_same(got: dict, want: dict) -> None:
    assert max_err(got["logits"], want["logits"]) < 1e-10
    assert max_err(got["logprobs"], want["logprobs"]) < 1e-10
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert grad.norm() > 0, name
        assert max_err(got["grads"][name], grad) < 1e-10, name


@pytest.mark.slow
@pytest.mark.usefixtures("float64_norms")
def test_two_ranks_give_one_ranks_logits_logprobs_and_gradients(tmp_path):
    out = tmp_path / "out.pt"
    packs = worker.cases()
    assert packs["shared"].prefix is not None and straddles(packs["shared"], 2)
    assert all(p.input_ids.shape[1] % 2 for p in packs.values())  # the last shard carries padding
    with start_child(torchrun_command(os.path.join(TESTS, "_sequence_parallel_worker.py"), str(out))) as proc:
        model = worker.tiny_llama()
        wants = {name: worker.run_case(model, packed) for name, packed in packs.items()}
        mqa = worker.run_case(worker.tiny_llama(kv_heads=1), packs["shared"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    two = torch.load(out, weights_only=False)

    for name, want in wants.items():
        assert_same(two[name], want)
    assert_same(two["mqa"], mqa)
    assert two["exchange"] == dict(forward=True, backward=True, inverse=True)
    assert "sequence_parallel=2 must divide the model's attention heads" in two["heads_error"]
    assert "it has 3 query heads and 3 key/value heads" in two["heads_error"]


def metrics_of(folder) -> list:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_torchrun_job_of_one_sequence_group_trains_as_one_process(tmp_path):
    """The command line on two ranks, one sequence group: generation, rewards, every pass and
    the metrics line of each step are one process's (float32), and rank 0 alone writes them."""
    train = ["-m", "grpo_fast", "train", "--steps", "2", "--no-progress", "--save-every", "0"]
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    proc = run_child(torchrun_command(*train, "--sequence-parallel", "2", "--output", two), timeout=180)
    assert proc.returncode == 0, proc.stderr[-5000:]
    proc = run_child([sys.executable, *train, "--output", one], timeout=180)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert_rows_close(metrics_of(two), metrics_of(one), rel=1e-4)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_sequence_parallel_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="sequence_parallel must be an int >= 1"):
        GRPOConfig(sequence_parallel=value).validate()


def test_the_flag_sets_the_degree_which_must_divide_the_world_size():
    args = build_parser().parse_args(dashed(["train", "--sequence-parallel", "2"]))
    assert make_config(args).sequence_parallel == 2
    with pytest.raises(ValueError, match="sequence_parallel=2 must divide the world size 1"):
        Ranks(torch.device("cpu"), 2)  # one process, no torchrun
    assert Ranks(torch.device("cpu")).data_size == 1


def test_the_trainers_policy_refuses_heads_the_degree_does_not_divide_before_any_pass():
    runtime = types.SimpleNamespace(ranks=types.SimpleNamespace(sequence_parallel=2))
    with pytest.raises(ValueError, match="sequence_parallel=2 must divide the model's attention heads: it has 3"):
        PackedPolicy(worker.tiny_llama(heads=3, kv_heads=3, hidden=48), LossConfig(), runtime)
    PackedPolicy(worker.tiny_llama(kv_heads=1), LossConfig(), runtime)  # one key/value head: repeated


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_hold_every_token_once_and_each_completion_token_on_its_predictors_rank(monkeypatch, size):
    """Each degree's shards, rank by rank (the group's size and rank faked): their tokens are the
    pack's, padded at the end only; every completion token is predicted on exactly one rank, at
    its predicting position. Also a 2-token row (a filler) on more ranks than it has tokens."""
    import torch.distributed as dist

    filler_ids = torch.zeros(1, 2, dtype=torch.long)
    packs = [*worker.cases().values(), pack(filler_ids, torch.ones_like(filler_ids), 1, slice(0, 1))]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
    for packed in packs:
        shards = []
        for rank in range(size):
            monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
            shards.append(sequence_shard(packed, None))
        S, T = packed.input_ids.shape[1], shards[0].length
        assert T * size >= S > T * (size - 1) or S < size
        assert all(part.input_ids.shape == part.position_ids.shape == (1, T) for part in shards)
        ids = torch.cat([part.input_ids for part in shards], 1)
        positions = torch.cat([part.position_ids for part in shards], 1)
        assert torch.equal(ids[:, :S], packed.input_ids) and not ids[:, S:].any()
        assert torch.equal(positions[:, :S], packed.position_ids) and not positions[:, S:].any()
        tokens = torch.cat([part.tokens for part in shards])
        assert torch.equal(tokens.sort().values, torch.arange(packed.targets.shape[1]))
        for part in shards:
            assert torch.equal(part.start + part.logit_index, packed.logit_index[part.tokens])


@pytest.mark.parametrize("world, size", [(2, 2), (8, 2), (8, 4), (12, 3)])
def test_sequence_and_data_parallel_groups_compose(world, size):
    """Each rank is in one sequence group of consecutive ranks and one data-parallel group; a
    sequence group's ranks are at one data rank (they hold the same rows), and a data-parallel
    group lists its ranks in data-rank order."""
    sequence, data = sequence_layout(world, size)
    for groups, count, length in ((sequence, world // size, size), (data, size, world // size)):
        assert len(groups) == count and all(len(g) == length for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
    for group in sequence:
        assert group == list(range(group[0], group[0] + size)) and len({r // size for r in group}) == 1
    for group in data:
        assert [r // size for r in group] == list(range(world // size))
