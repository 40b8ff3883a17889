"""Helpers of tests/test_distributed.py, at any world size.

As a script under torchrun (``torchrun --standalone --nproc-per-node 2 _distributed_worker.py
JOB OUT``) it runs the job's cases on this rank's share of the job's fixed rollout batch and
rank 0 saves the results to OUT; the test computes the same cases at world size 1 in its own
process with the same functions. As a module it holds reward functions that runs of
``grpo-fast train`` name as ``_distributed_worker:NAME`` (tests/ on PYTHONPATH).
"""

import dataclasses
import os
import sys
import time

import torch
from _float64 import patch_llama_norms

from grpo_fast.tasks.arithmetic import arithmetic_reward, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.update.batch import packed_logprobs
from grpo_fast.trainer.update.metrics import read_metrics
from grpo_fast.trainer.update.passes import Proximal

SMALL = dict(batch_size=16, group_size=4, max_new_tokens=3, progress=False, beta=0.1)


def rank() -> int:
    return int(os.environ.get("RANK", 0))


# ---------------------------------------------------------------- rewards for the CLI runs
_calls = []


def arithmetic_or_pause(prompts, completions, **columns):
    """The demo's reward; with GRPO_FAST_TEST_PAUSE=N, rank 1's call N + 1 touches the file
    GRPO_FAST_TEST_PAUSED and sleeps (a rank stuck mid-run, for the test to kill)."""
    _calls.append(1)
    pause = os.environ.get("GRPO_FAST_TEST_PAUSE")
    if pause is not None and rank() == 1 and len(_calls) > int(pause):
        open(os.environ["GRPO_FAST_TEST_PAUSED"], "w").close()
        time.sleep(600)
    return arithmetic_reward(prompts, completions, **columns)


def fails_on_rank_1(prompts, completions, **columns):
    if rank() == 1:
        raise KeyError("no answer column on rank 1")
    return arithmetic_reward(prompts, completions, **columns)


def hangs_on_rank_1(prompts, completions, **columns):
    """Rank 1 stalls 20 s, four times the test's collective timeout: rank 0 gives up first. (A
    stall without end would keep the job another 30 s: torchrun's SIGTERM only asks a rank to
    checkpoint after its step, so torchrun waits its grace period before SIGKILL.)"""
    if rank() == 1:
        time.sleep(20)
    return arithmetic_reward(prompts, completions, **columns)


def odd_only_reward(prompts, completions, **columns):
    """An even first digit: every sample scores 1 (no signal; dynamic sampling drops the group)."""
    return [1.0 if int(p[0]) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


# ---------------------------------------------------------------- gradients of one fixed batch
def trainer_for(case: dict, output_dir: str) -> GRPOTrainer:
    """The case's trainer: the demo model (float64 when asked) and the SMALL run with the case's keys."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=1).to(case.get("dtype", torch.float32))
    config = GRPOConfig(**{**SMALL, "output_dir": output_dir, **case.get("config", {})})
    return GRPOTrainer(config, model=model, tokenizer=tokenizer)


def fixed_batch(trainer: GRPOTrainer) -> tuple:
    """``(samples, old log-probs [N, C])``: the trainer's first samples (world size 1) and
    log-probs 0.3-normal noise away from the policy's (0 past each completion), so that the
    ratios of a later pass (num_iterations > 1) leave the trust region and clip."""
    samples = trainer.source.next(0, 0)
    batch = trainer.prepare(samples)
    mask, modules = batch.completion_mask, trainer.modules
    old = packed_logprobs(modules.packed, batch.micro_batches, trainer.runtime.ranks, modules.filler, mask)
    noise = 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0), dtype=old.dtype)
    return samples, (old + noise) * mask


def rows_of(samples, start: int, stop: int):
    """Rows [start, stop) of ``samples``."""
    tensors = {
        f.name: getattr(samples, f.name)[start:stop]
        for f in dataclasses.fields(samples)
        if torch.is_tensor(getattr(samples, f.name))
    }
    return dataclasses.replace(
        samples,
        prompts=samples.prompts[start:stop],
        completions=samples.completions[start:stop],
        columns={key: values[start:stop] for key, values in samples.columns.items()},
        **tensors,
    )


def case_gradients(case: dict, fixed: tuple, output_dir: str) -> dict:
    """One later pass (the old log-probs of ``fixed`` as the proximal policy's) over this rank's
    rows of the fixed samples (``case["split"]``: rows per rank), from the step's batch that
    ``prepare`` builds (advantages over every rank's rewards, reference log-probs, micro-batches):
    the whole gradient (gathered from the shards under FSDP2) and the pass's metrics, summed
    over ranks. The split is per data-parallel rank: a sequence group's ranks take the same rows."""
    trainer = trainer_for(case, output_dir)
    ranks = trainer.runtime.ranks
    samples, old = fixed
    start, stop = 0, samples.input_ids.shape[0]
    if ranks.data_size > 1:
        start = sum(case["split"][: ranks.data_rank])
        stop = start + case["split"][ranks.data_rank]
    batch = trainer.prepare(rows_of(samples, start, stop))
    result = trainer.accumulate_gradients(batch, Proximal(old[start:stop], None, {}))
    sums = read_metrics([result.metrics], ranks, trainer.runtime.device)[0]
    trainable = [p for p in trainer.policy.parameters() if p.requires_grad]
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in trainable]
    return dict(grads=torch.cat([g.detach().flatten().cpu() for g in grads]), sums=sums)


def dynamic_sampling_step(output_dir: str) -> dict:
    """One step with dynamic sampling (rounds and dropped groups agreed over ranks)."""
    config = GRPOConfig(
        **{**SMALL, "output_dir": output_dir, "dynamic_sampling": True, "max_sampling_rounds": 4, "beta": 0.1}
    )
    tokenizer = build_tokenizer()
    trainer = GRPOTrainer(
        config, model=build_model(tokenizer, seed=1), tokenizer=tokenizer, reward_funcs=[odd_only_reward]
    )
    return trainer.train_step()


def lora_run(parallel: str, output_dir: str) -> list:
    """Two steps of a LoRA run with gradient checkpointing (one layer input in two kept: under
    FSDP2, the refill's forwards gather the weights inside the backward), checkpointed each step."""
    config = dict(lora_r=4, gradient_checkpointing=True, checkpoint_every=2, parallel=parallel, steps=2, save_every=1)
    return trainer_for(dict(config=config), output_dir).train()


def main(job_path: str, out_path: str) -> None:
    patch_llama_norms()  # as the parent's one-process numbers: float64 to 1e-10 (tests/_float64.py)
    job = torch.load(job_path, weights_only=False)
    results = dict(cases=[], rank_errors=None)
    scratch = os.path.dirname(out_path)
    for case in job["cases"]:
        results["cases"].append(case_gradients(case, job["fixed"][case["batch"]], scratch))
    try:
        trainer_for(dict(config=dict(batch_size=12)), scratch)  # 3 prompts a step: not divisible by 2 ranks
    except ValueError as exc:
        results["rank_errors"] = str(exc)
    try:
        trainer_for(dict(config=dict(sequence_parallel=3)), scratch)
    except ValueError as exc:
        results["sequence_error"] = str(exc)
    results["dynamic"] = dynamic_sampling_step(scratch)
    results["lora"] = lora_run("fsdp", job["lora_dir"])
    if rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
