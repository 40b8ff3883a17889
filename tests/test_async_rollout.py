"""Asynchronous rollouts (max_staleness K >= 1): the sampling correction's metrics against TRL's
formulas in float64, the trainer's loss on stale batches against the float64 reference, what the
worker computes beside its samples, bad settings, resume, and the failures (worker error, worker
killed, trainer killed, Ctrl-C).

Each trainer here starts a worker process (spawn: a fresh interpreter that imports torch), so
these tests use the demo's tiny model and few steps, and one worker checks all it can.
"""

import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import (
    ROOT,
    assert_rows_close,
    children,
    completion_logits,
    rel_err,
    small_config,
    start_child,
    torchrun_command,
    trl_sampling_correction,
    wait_until,
    without_timings,
)

from grpo_fast import reference
from grpo_fast.spec import SAMPLING_CORRECTIONS, sampling_correction
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.distributed import Ranks
from grpo_fast.trainer.model.build import reference_context
from grpo_fast.trainer.rollout.sources import InProcessRollouts
from grpo_fast.trainer.rollout.worker import WeightSlots, WorkerError
from grpo_fast.trainer.run.run_log import read_metrics
from grpo_fast.trainer.update.batch import packed_logprobs
from grpo_fast.trainer.update.passes import sampling_metrics


@pytest.mark.parametrize("mode", list(SAMPLING_CORRECTIONS))
def test_sampling_metrics_are_trls(mode):
    """The correction's sampling/... metrics as TRL defines them, with a NaN sampling log-prob
    and a row without tokens: |proximal - sampling| over active tokens, the ratio over active
    tokens (token modes) or over every sequence (sequence modes)."""
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    proximal = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampling = proximal + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    sampling[1, 2] = math.nan
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[3] = 0
    correction = sampling_correction(proximal, sampling, mask, mode=mode, clip_min=0.5, clip_max=1.5)
    metrics = sampling_metrics(
        proximal, sampling, mask, correction.ratio, mode.startswith("sequence"), Ranks(torch.device("cpu"))
    )
    expected = trl_sampling_correction(proximal, sampling, mask, mode, 0.5, 1.5)
    active = mask.bool() & ~sampling.isnan()
    gap = (proximal - sampling).abs()[active]
    flat = expected.flatten() if mode.startswith("sequence") else expected[mask.bool()]
    want = {
        "sampling/sampling_logp_difference/mean": gap.mean(),
        "sampling/sampling_logp_difference/max": gap.max(),
        "sampling/importance_sampling_ratio/min": flat.min(),
        "sampling/importance_sampling_ratio/mean": flat.mean(),
        "sampling/importance_sampling_ratio/max": flat.max(),
    }
    got = {key: value.item() for key, value in metrics.items()}
    assert got == pytest.approx({key: value.item() for key, value in want.items()}, rel=1e-12)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(max_staleness=-1), "max_staleness must be an int >= 0"),
        (dict(max_staleness=1.5), "max_staleness must be an int >= 0"),
        (dict(generation_device="cpu"), "generation_device='cpu' needs max_staleness >= 1"),
        (dict(max_staleness=1, generation_device="cuda:7"), r"generation_device='cuda:7' does not exist"),
        (dict(max_staleness=1, generation_device="gpu1"), "generation_device must be a device such as"),
        (dict(max_staleness=1, dynamic_sampling=True), "max_staleness >= 1 does not work with dynamic_sampling"),
        (dict(max_staleness=1, parallel="fsdp"), "max_staleness >= 1 needs parallel='ddp'"),
    ],
)
def test_bad_asynchronous_settings_are_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, match):
    from grpo_fast.trainer import grpo

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(grpo, "load_model_and_tokenizer", no_loading)
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(small_config(tmp_path, **overrides))


def test_synchronous_loop_starts_no_worker_and_has_no_correction(tmp_path):
    """K = 0 is today's loop: samples from the engine in this process, without sampling
    log-probs; the first pass records neither log-probs nor importance weights (the ratio's old
    log-probs are left to the loss: on-policy); no asynchronous or sampling metrics."""
    trainer = GRPOTrainer(small_config(tmp_path))
    assert isinstance(trainer.source, InProcessRollouts)
    metrics, batch = trainer.run_step()
    assert batch.samples.sampling_logprobs is None and batch.samples.policy_version is None
    first = trainer.accumulate_gradients(batch, None)
    assert first.logprobs is None and first.weights is None
    assert "staleness" not in metrics and not any(key.startswith("sampling/") for key in metrics)


def gradient_step(trainer):
    """One training step: ``(its StepBatch, its metrics, [(the gradient [P] flat as an optimizer
    step receives it, the policy it was computed at)] for each of its passes)``."""
    passes, optimizer_step = [], trainer.optimizer_step

    def recorded(loss):
        gradient = torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])
        passes.append((gradient, copy.deepcopy(trainer.policy)))
        return optimizer_step(loss)

    trainer.optimizer_step = recorded
    try:
        metrics, batch = trainer.run_step()
    finally:
        del trainer.optimizer_step
    return batch, metrics, passes


@pytest.mark.parametrize(
    "fused_linear, mode, num_iterations",
    [(False, "token_truncate", 1), (True, "sequence_truncate", 2)],
    ids=["logits-token", "fused_linear-sequence-2passes"],
)
def test_stale_batches_train_on_the_float64_reference_loss_with_the_correction(
    tmp_path, fused_linear, mode, num_iterations
):
    """K = 2: each pass's gradient is the float64 reference loss's on its batch, at the pass's
    weights, with the step's first weights as the proximal (old) policy and TRL's truncated
    weight of proximal vs the sampler's log-probs (computed in the first pass, no extra
    forward); the batches are stale (the worker samples ahead: 3 steps give staleness 0, 1, 2);
    the first batch, sampled by the initial weights, is the synchronous loop's first batch with
    its gradient."""
    overrides = dict(sampling_correction=mode, sampling_correction_max=1.02, num_iterations=num_iterations)
    overrides.update(beta=0.04, learning_rate=3e-2, fused_linear=fused_linear)
    sync_batch, _, sync_passes = gradient_step(GRPOTrainer(small_config(tmp_path / "sync", **overrides)))
    trainer = GRPOTrainer(small_config(tmp_path, max_staleness=2, **overrides))
    try:
        records = [gradient_step(trainer) for _ in range(3)]
    finally:
        trainer.close()
    assert records[0][0].samples.completions == sync_batch.samples.completions
    assert rel_err(records[0][2][0][0], sync_passes[0][0]) < 1e-5
    staleness = [metrics["staleness"] for _, metrics, _ in records]
    assert max(staleness) >= 1 and all(0 <= s <= 2 for s in staleness), staleness
    clipped = 0
    for batch, metrics, passes in records:
        assert len(passes) == num_iterations
        samples, C = batch.samples, batch.completion_mask.shape[1]
        ids, mask = samples.input_ids[:, -C:], batch.completion_mask.double()

        def logits_at(policy):
            return completion_logits(policy.double(), samples.input_ids, samples.attention_mask, C)

        proximal = reference.token_logprobs(logits_at(passes[0][1]), ids).detach()
        weights = trl_sampling_correction(proximal, samples.sampling_logprobs.double(), mask, mode, None, 1.02)
        weights = weights.expand_as(mask)  # a sequence mode's ratio [N, 1] on each of its tokens
        clipped += int((weights[mask.bool()] == 1.02).sum())
        for gradient, policy in passes:
            policy = policy.double()
            reference.grpo_loss(
                logits_at(policy),
                ids,
                batch.advantages.double(),
                mask,
                proximal,
                batch.ref_logprobs.double(),
                importance_weights=weights,
                beta=0.04,
                max_completion_length=3,
            ).loss.backward()
            expected = torch.cat([p.grad.flatten() for p in policy.parameters()])
            assert rel_err(gradient, expected) < 1e-4
        assert metrics["sampling/importance_sampling_ratio/max"] <= 1.02 + 1e-6
    assert clipped > 0  # the cap was reached: the correction is exercised, not all ones
    first = records[0][1]  # the worker starts at the first request: the trainer waits out its rollout
    assert first["rollout_wait_s"] >= first["worker_rollout_s"] > 0, first


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["whole-rows", "shared-prefix"])
def test_the_worker_computes_sampling_and_reference_log_probs_as_the_trainer_would(tmp_path, shared_prefix):
    """What the worker computes beside its samples, with the trainer's packing, on a named
    device. The Hugging Face engine returns no log-probs: the worker computes the sampling
    log-probs with a forward under the weights that sampled, so a fresh batch's weights are 1.
    With beta != 0 the worker computes the reference log-probs of its batch's first
    micro-batches for as long as the trainer has not asked for that batch: none of the first
    (the trainer waits for it), all of the second while the trainer's step is slow. Either way
    they are the values the trainer computes itself (the same packed micro-batches, each
    group's prompt once in both with ``shared_prefix``)."""
    config = small_config(
        tmp_path,
        max_staleness=1,
        generator="hf",
        generation_device="cpu",
        beta=0.04,
        micro_batch_size=4,
        shared_prefix=shared_prefix,
    )
    trainer = GRPOTrainer(config)
    publish = trainer.source.publish

    def slow_publish(policy, version):
        time.sleep(2.0)  # a trainer step longer than the worker's batch
        publish(policy, version)

    trainer.source.publish = slow_publish
    steps = []
    try:
        for _ in range(2):
            metrics, batch = trainer.run_step()
            steps.append(metrics)
            with reference_context(trainer.policy, trainer.reference):
                own = packed_logprobs(
                    trainer.modules.reference,
                    batch.micro_batches,
                    trainer.runtime.ranks,
                    trainer.modules.filler,
                    batch.completion_mask,
                )
            assert len(batch.micro_batches) == 4 and torch.equal(batch.ref_logprobs, own)
            assert all((p.prefix is not None) == shared_prefix for p in batch.micro_batches)
        worker = trainer.source.process
    finally:
        trainer.close()
    assert [m["staleness"] for m in steps] == [0, 1]
    assert abs(steps[0]["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    assert steps[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert [m["worker_reference_share"] for m in steps] == [0.0, 1.0]
    assert worker.exitcode == 0  # it saw the stop where it waited and left (not terminated)


def failing_reward(prompts, completions, **columns):
    raise ArithmeticError("the judge is out to lunch")


def test_worker_error_reaches_the_trainer(tmp_path):
    trainer = GRPOTrainer(small_config(tmp_path, max_staleness=1), reward_funcs=[failing_reward])
    try:
        with pytest.raises(WorkerError, match="the judge is out to lunch"):
            trainer.train_step()
    finally:
        trainer.close()


def test_resume_samples_after_the_trained_steps_and_a_killed_worker_stops_the_trainer(tmp_path):
    """Batches in flight when a checkpoint is written are not in it: a resumed run samples
    them again, from the data position after the last trained batch. Its worker SIGKILLed, the
    trainer raises within seconds (a batch the worker finished before dying may still be
    trained on), and ``resume(auto=True)`` picks the run up again from its checkpoint, with
    the step the killed run had trained."""
    trainer = GRPOTrainer(small_config(tmp_path, max_staleness=1, steps=2))
    trainer.train()
    assert trainer.source.process is None  # train() stopped its worker
    resumed = GRPOTrainer(small_config(tmp_path, max_staleness=1, steps=50))
    assert resumed.resume() == 2 and resumed.data_position == 2 * resumed.config.rollout.prompts_per_step
    try:
        metrics = resumed.train_step()
        assert metrics["step"] == 3 and resumed.data_position == 3 * resumed.config.rollout.prompts_per_step
        os.kill(resumed.source.process.pid, signal.SIGKILL)
        killed = time.perf_counter()
        with pytest.raises(WorkerError, match=r"died \(exit code -9\)"):
            for _ in range(3):
                resumed.train_step()
        assert time.perf_counter() - killed < 10
    finally:
        resumed.close()
    again = GRPOTrainer(small_config(tmp_path, max_staleness=1, steps=50))
    try:
        assert again.resume(auto=True) == 2
        assert without_timings([again.train_step()]) == without_timings([metrics])
    finally:
        again.close()


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


TRAINER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from grpo_fast.trainer import GRPOConfig, GRPOTrainer
    config = GRPOConfig(batch_size=16, group_size=4, max_new_tokens=3, progress=False, max_staleness=1,
                        output_dir=sys.argv[1])
    trainer = GRPOTrainer(config)
    trainer.train_step()
    print(trainer.source.process.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_trainer_ends_its_worker(tmp_path):
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_SCRIPT, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        worker = int(trainer.stdout.readline())
        assert not gone(worker)
        trainer.kill()
        trainer.wait()
        assert wait_until(lambda: gone(worker), 5)
    finally:
        trainer.kill()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_trainer_and_worker(tmp_path):
    """SIGINT to the terminal's process group (what Ctrl-C sends): the trainer stops and takes
    its worker with it; nothing is left running."""
    # `python -m grpo_fast` as a terminal's foreground job runs it: with Python's SIGINT handler
    # (a job started in the background of a non-interactive shell, as a CI step may be,
    # inherits SIGINT ignored, and Python then installs none).
    main = "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    main += "runpy.run_module('grpo_fast', run_name='__main__', alter_sys=True)"
    command = [sys.executable, "-c", main, "train", "--max-staleness", "1", "--steps", "100000"]
    command += ["--no-progress", "--output-dir", str(tmp_path / "run")]
    trainer = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 120)  # training, worker running
        workers = children(trainer.pid)  # the rollout worker (and its multiprocessing helpers)
        assert workers
        os.killpg(trainer.pid, signal.SIGINT)
        try:
            trainer.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(trainer.pid, signal.SIGKILL)
            pytest.fail(f"still running 30 s after SIGINT; its stderr:\n{trainer.stderr.read()[-3000:]}")
        assert trainer.returncode != 0
        assert wait_until(lambda: all(gone(pid) for pid in workers), 5)
        assert "KeyboardInterrupt" in trainer.stderr.read()
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)


@pytest.mark.slow
def test_asynchronous_demo_learns(tmp_path):
    """K = 1 on the demo task learns (the reward rises): the measured comparison with the
    synchronous run is in benchmarks/NOTES.md."""
    trainer = GRPOTrainer(small_config(tmp_path, max_staleness=1, steps=40, batch_size=32, max_new_tokens=4))
    history = trainer.train()
    first = sum(m["reward_mean"] for m in history[:5]) / 5
    last = sum(m["reward_mean"] for m in history[-5:]) / 5
    assert last > first + 0.1, (first, last)


@pytest.mark.slow
def test_torchrun_two_ranks_each_with_a_worker_train_as_one_process(tmp_path):
    """Under torchrun (2 processes, gloo) each rank's worker samples that rank's share of the
    prompts: the samples are a function of (seed, key, sample index) and the weights, and the
    staleness is the same, so the rows equal one process's with K = 1 to 1e-4 (the world sizes'
    summed gradients round apart; see test_distributed); the job ends with its workers."""
    args = ["--max-staleness", "1", "--steps", "3", "--save-every", "0", "--no-progress"]
    out = str(tmp_path / "two")
    config = GRPOConfig(max_staleness=1, steps=3, save_every=0, progress=False, output_dir=str(tmp_path / "one"))
    threads = torch.get_num_threads()
    with start_child(torchrun_command("-m", "grpo_fast", "train", "--output-dir", out, *args)) as proc:
        torch.set_num_threads(2)  # one thread for the trainer, one for its worker, as each rank
        try:
            alone = GRPOTrainer(config).train()  # while the job runs
        finally:
            torch.set_num_threads(threads)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = read_metrics(out)
    assert [m["staleness"] for m in rows] == [m["staleness"] for m in alone] == [0, 1, 1]
    assert_rows_close(rows, alone, rel=1e-4)


def test_the_worker_reads_the_version_a_batch_is_due_or_the_newest_once_it_is_overwritten():
    import multiprocessing

    weight = torch.zeros(3)
    slots = WeightSlots([("w", weight)], version=0, context=multiprocessing.get_context("spawn"))
    for version in (1, 2):  # the trainer's two optimizer steps
        slots.write([("w", torch.full((3,), float(version)))], version)
    params = {"w": torch.zeros(3)}
    assert slots.read(params, loaded=-1, wanted=1) == 1 and params["w"].tolist() == [1.0] * 3  # due, still held
    assert slots.read(params, loaded=1, wanted=0) == 2 and params["w"].tolist() == [2.0] * 3  # overwritten: newest
    params["w"].zero_()
    assert slots.read(params, loaded=2, wanted=2) == 2 and params["w"].tolist() == [0.0] * 3  # loaded: no copy
    assert slots.read(params, loaded=2, wanted=-1) == 2  # before the run's first version: the newest
