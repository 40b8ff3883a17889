"""Faults done to real runs: non-finite gradients, a full disk, a corrupted checkpoint, preemption
signals (the run in this process, then the CLI with its exit status, synchronous and with the
asynchronous worker). Each test checks what the run kept and what it said, against the same
run left alone (docs/reliability.md is the matrix of these).

Runs use the demo's tiny model at the SMALL size (tens of milliseconds a step)."""

import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import one_thread, small_config, without_timings

from grpo_fast.tasks.arithmetic import arithmetic_reward
from grpo_fast.trainer import GRPOTrainer
from grpo_fast.trainer.run import checkpoint as ckpt
from grpo_fast.trainer.run import faults
from grpo_fast.trainer.run.run_log import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(trainer) -> list:
    return [p.detach().clone() for p in trainer.policy.parameters()]


def nan_gradients(trainer, steps: set) -> None:
    """The first weight's gradient is NaN in the training steps ``steps`` (1-based)."""
    first = next(trainer.policy.parameters())
    first.register_hook(lambda grad: grad * float("nan") if trainer.step + 1 in steps else grad)


def test_nonfinite_gradients_skip_the_step_and_too_many_in_a_row_stop_the_run(tmp_path):
    """NaN gradients in steps 3 and 4: both skipped on the device (weights, AdamW moments and
    step count as after step 2), counted in their log lines, the run goes on and learns from
    step 5 as a run that never had them would from its step 3's weights. Then NaN from step 3
    on with max_nonfinite_steps=3: the run stops after step 5 naming the steps, and every
    checkpoint it wrote holds step 2's finite weights."""
    trainer = GRPOTrainer(small_config(tmp_path, steps=6, save_every=2, keep_checkpoints=3))
    nan_gradients(trainer, {3, 4})
    after = []
    for _ in range(6):
        metrics = trainer.train_step()
        after.append(
            (metrics["nonfinite_steps"], weights(trainer), int(trainer.optimizer.state_dict()["state"][0]["step"]))
        )
    assert [count for count, _, _ in after] == [0, 0, 1, 1, 0, 0]
    for s in (2, 3):  # steps 3 and 4 changed nothing
        assert all(torch.equal(p, q) for p, q in zip(after[s][1], after[1][1])) and after[s][2] == 2
    assert not all(torch.equal(p, q) for p, q in zip(after[4][1], after[1][1])) and after[4][2] == 3
    assert all(torch.isfinite(p).all() for p in after[5][1])

    stopping = GRPOTrainer(
        small_config(tmp_path, output_dir=str(tmp_path / "stop"), steps=8, save_every=2, keep_checkpoints=5)
    )
    nan_gradients(stopping, set(range(3, 9)))
    with pytest.raises(faults.NonFiniteSteps, match=r"steps 3 to 5 \(3 in a row, max_nonfinite_steps=3\)"):
        stopping.train()
    assert [m["nonfinite_steps"] for m in read_metrics(str(tmp_path / "stop"))] == [0, 0, 1, 1, 1]
    saved = ckpt.list_checkpoints(str(tmp_path / "stop"))
    assert [os.path.basename(p) for p in saved] == ["step-000002", "step-000004"]
    loaded = GRPOTrainer(small_config(tmp_path, output_dir=str(tmp_path / "stop"), steps=8))
    assert loaded.resume() == 4
    assert all(torch.equal(p, q) for p, q in zip(weights(loaded), after[1][1]))

    with torch.no_grad():  # a weight that went bad anyway is never written
        next(loaded.policy.parameters())[0, 0] = float("inf")
    loaded.step = 5
    with pytest.raises(ckpt.CheckpointSaveError, match="step-000005' not written: the weights hold a NaN"):
        loaded.save_checkpoint()
    assert ckpt.latest_checkpoint(str(tmp_path / "stop")) == saved[-1]


def full_disk_at(monkeypatch, step_of, failing_step: int) -> list:
    """DCP's writes of the checkpoint of ``failing_step`` (``step_of()``: the trainer's step) get
    half their bytes out, then ENOSPC, as on a full disk; returns the files that failed."""
    import torch.distributed.checkpoint.filesystem as filesystem

    write, failed = filesystem._write_item, []

    def write_item(transforms, stream, data, *args):
        if step_of() != failing_step:
            return write(transforms, stream, data, *args)
        stream.write(b"\0" * 4096)
        failed.append(stream.name)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)

    monkeypatch.setattr(filesystem, "_write_item", write_item)
    return failed


@pytest.mark.parametrize("on_save_failure", ["stop", "continue"])
def test_a_full_disk_leaves_the_previous_checkpoint_and_stops_or_goes_on(
    tmp_path, monkeypatch, caplog, on_save_failure
):
    """ENOSPC on the policy's shards at the step-4 save: the partial folder is removed, step 2's
    checkpoint is intact and loads, and one line names the path and the cause. 'stop' ends the
    run there (exit 2 from the CLI); 'continue' logs it, trains on and writes step 6's."""
    run = str(tmp_path / "run")
    trainer = GRPOTrainer(
        small_config(tmp_path, steps=6, save_every=2, keep_checkpoints=3, on_save_failure=on_save_failure)
    )
    failed = full_disk_at(monkeypatch, lambda: trainer.step, 4)
    message = (
        r"step-000004' not written \(.*No space left on device.*\); its partial folder is removed, "
        r"the newest checkpoint is '.*step-000002'"
    )
    if on_save_failure == "stop":
        with pytest.raises(ckpt.CheckpointSaveError, match=message):
            trainer.train()
        assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    else:
        with caplog.at_level(logging.WARNING, logger="grpo_fast"):
            trainer.train()
        assert [r.getMessage() for r in caplog.records if "not written" in r.getMessage()][0].endswith(
            "training goes on (on_save_failure='continue')"
        )
        assert len(read_metrics(run)) == 6 and os.path.isdir(os.path.join(run, "final"))
    assert failed and os.path.basename(failed[0]).endswith(".distcp")
    names = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert names == (["step-000002"] if on_save_failure == "stop" else ["step-000002", "step-000006"])
    ckpt.verify_checkpoint(ckpt.checkpoint_path(run, 2))
    assert GRPOTrainer(small_config(tmp_path, steps=6)).resume(ckpt.checkpoint_path(run, 2)) == 2


def signalling_reward(at_call: int, sleep_s: float = 0.0, signum=signal.SIGTERM):
    """The demo's reward, which at its call ``at_call`` signals this process (a scheduler's
    preemption arriving mid-step) and then takes ``sleep_s`` (a slow step)."""
    calls = []

    @functools.wraps(arithmetic_reward)
    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)
            time.sleep(sleep_s)
        return arithmetic_reward(prompts, completions, **columns)

    return reward


@pytest.mark.parametrize("grace", [60.0, 0.2], ids=["step_finishes", "step_dropped"])
def test_preemption_saves_and_resume_auto_continues_bit_exact(tmp_path, grace):
    """SIGTERM in step 5's rewards. With the grace time ahead, step 5 finishes and is saved;
    past it (the rewards take 3 s, the grace 0.2 s), step 5 is dropped and step 4's state is
    saved. Either way the run raises Preempted (status 75) with its source closed, the previous
    SIGTERM handler is back, and resume('auto') ends with the uninterrupted run's metrics
    and weights."""
    options = dict(steps=8, save_every=3, keep_checkpoints=3, lr_schedule="cosine", preemption_grace_s=grace)
    full = GRPOTrainer(small_config(tmp_path, output_dir=str(tmp_path / "full"), **options)).train()
    previous = signal.getsignal(signal.SIGTERM)
    cut = str(tmp_path / "cut")
    preempted = GRPOTrainer(
        small_config(tmp_path, output_dir=cut, **options), reward_funcs=[signalling_reward(5, sleep_s=3.0)]
    )
    start = time.perf_counter()
    with pytest.raises(faults.Preempted) as stop:
        preempted.train()
    elapsed = time.perf_counter() - start
    step = 5 if grace > 1 else 4
    assert (stop.value.step, stop.value.signal_name, stop.value.dropped) == (step, "SIGTERM", grace < 1)
    assert stop.value.exit_status == 75 and f"step-00000{step}" in str(stop.value)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, step)
    assert [m["step"] for m in read_metrics(cut)] == list(range(1, step + 1))
    if grace < 1:
        assert elapsed < 3.0 + 2.0  # the dropped step did not wait out its rewards' sleep... much

    resumed = GRPOTrainer(small_config(tmp_path, output_dir=cut, **options))
    assert resumed.resume(auto=True) == step
    resumed.train()
    assert without_timings(read_metrics(cut)) == without_timings(full)
    assert same_final_weights(cut, str(tmp_path / "full"))


def test_a_reward_whose_process_dies_stops_the_run_and_resume_auto_continues(tmp_path):
    """A reward function whose judge process is SIGKILLed in step 3 (the OOM killer's way):
    the run stops at once with a RewardError naming the function and the death, the
    checkpoint of step 2 intact and the last one; ``resume(auto=True)`` continues from it and
    ends with the metrics and weights of the run left alone."""
    from conftest import same_weights, without_timings

    from grpo_fast.trainer import RewardError

    options = dict(steps=4, save_every=2, keep_checkpoints=2)
    whole = GRPOTrainer(small_config(tmp_path, output_dir=str(tmp_path / "full"), **options))
    full = whole.train()
    calls = []

    @functools.wraps(arithmetic_reward)
    def judged(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 3:
            subprocess.run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], check=True)
        return arithmetic_reward(prompts, completions, **columns)

    cut = str(tmp_path / "cut")
    start = time.perf_counter()
    with pytest.raises(
        RewardError, match=r"reward function 'arithmetic_reward' raised CalledProcessError: .* died with"
    ):
        GRPOTrainer(small_config(tmp_path, output_dir=cut, **options), reward_funcs=[judged]).train()
    assert time.perf_counter() - start < 30
    assert ckpt.latest_valid_checkpoint(cut) == ckpt.checkpoint_path(cut, 2)
    resumed = GRPOTrainer(small_config(tmp_path, output_dir=cut, **options))
    assert resumed.resume(auto=True) == 2
    resumed.train()
    assert without_timings(read_metrics(cut)) == without_timings(full)
    assert same_weights(resumed, whole)


def test_resume_auto_starts_fresh_and_skips_a_corrupted_checkpoint(tmp_path, caplog):
    """``resume(auto=True)`` on an empty output dir starts at step 0 (a metrics file left by a
    run that died before its first checkpoint is dropped); on a run whose newest checkpoint has
    a flipped byte it warns naming the file and continues from the one before, bit-exact."""
    options = dict(steps=6, save_every=2, keep_checkpoints=3)
    run = str(tmp_path / "run")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    fresh = GRPOTrainer(small_config(tmp_path, **options))
    assert fresh.resume(auto=True) == 0 and fresh.history == []
    full = fresh.train()

    cut = str(tmp_path / "cut")
    shutil.copytree(run, cut)
    shutil.rmtree(ckpt.checkpoint_path(cut, 6))
    shards = os.path.join(ckpt.checkpoint_path(cut, 4), "__0_0.distcp")
    data = bytearray(open(shards, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(shards, "wb").write(bytes(data))
    resumed = GRPOTrainer(small_config(tmp_path, output_dir=cut, **options))
    with caplog.at_level(logging.WARNING, logger="grpo_fast"):
        assert resumed.resume(auto=True) == 2
    assert any(
        "step-000004" in r.getMessage() and "__0_0.distcp fails its CRC-32 check" in r.getMessage()
        for r in caplog.records
    )
    resumed.train()
    assert without_timings(read_metrics(cut)) == without_timings(full)


# ---------------------------------------------------------------- the CLI, a process of its own
STEPS = 16  # the demo's: a signal after its third step finds it mid-run
CLI = [sys.executable, "-m", "grpo_fast", "train", "--steps", str(STEPS), "--save-every", "0", "--no-progress"]


def wait_for_steps(path: str, steps: int, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(read_metrics(os.path.dirname(path))) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never logged {steps} steps (exit {proc.poll()})")


@pytest.mark.parametrize(
    "mode,signum,group",
    [([], signal.SIGTERM, False), (["--max-staleness", "1"], signal.SIGUSR1, True)],
    ids=["sync_sigterm", "async_sigusr1_to_the_group"],
)
def test_cli_preempted_exits_75_and_resume_auto_finishes_as_the_uninterrupted_run(tmp_path, mode, signum, group):
    """``grpo-fast train`` signalled mid-run, at whatever step it is in (the demo, STEPS steps,
    no periodic checkpoint): it exits 75 within seconds, saying so in one line, with a
    checkpoint of the last step its metrics logged; the asynchronous worker, signalled with
    the whole process group (as SLURM signals a job step), ignores it and is stopped by the
    trainer. ``--resume auto`` then continues bit for bit as from a periodic checkpoint of that
    step: the synchronous run ends with the uninterrupted run's metrics and final weights; the
    asynchronous one with those of the uninterrupted run resumed from its checkpoint of that
    step (batches in flight at a checkpoint are sampled again, at the newer weights)."""
    from grpo_fast.cli import main

    periodic, cut = str(tmp_path / "periodic"), str(tmp_path / "cut")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [*CLI, *mode, "--output", cut], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for_steps(os.path.join(cut, "metrics.jsonl"), 3, proc)
        os.killpg(proc.pid, signum) if group else os.kill(proc.pid, signum)
        sent = time.time()
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, stderr[-3000:]
    assert time.time() - sent < 30
    step = len(read_metrics(cut))
    assert 3 <= step < STEPS
    assert f"grpo-fast: preempted by {signal.Signals(signum).name}: checkpoint of step {step}" in stderr
    assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, step)
    assert not [d for d in os.listdir(os.path.join(cut, "checkpoints")) if d.startswith(".tmp")]

    args = ["train", "--steps", str(STEPS), "--no-progress", *mode]
    assert one_thread(lambda: main([*args, "--output", cut, "--resume", "auto"])) == 0
    assert (
        one_thread(lambda: main([*args, "--output", periodic, "--save-every", "1", "--keep-checkpoints", str(STEPS)]))
        == 0
    )
    truth = read_metrics(periodic)
    if mode:
        for later in ckpt.list_checkpoints(periodic)[step:]:
            shutil.rmtree(later)
        assert one_thread(lambda: main([*args, "--output", periodic, "--resume", "auto"])) == 0
        assert without_timings(read_metrics(periodic)[:step]) == without_timings(truth[:step])
        truth = read_metrics(periodic)
    assert without_timings(read_metrics(cut)) == without_timings(truth)
    assert same_final_weights(cut, periodic)


def same_final_weights(run: str, other: str) -> bool:
    """The two runs' final models (``final/model.safetensors``) hold bit-equal weights."""
    from safetensors.torch import load_file

    one, two = (load_file(os.path.join(path, "final", "model.safetensors")) for path in (run, other))
    return one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_torchrun_preempted_by_one_rank_or_the_launcher_saves_one_step_and_resumes_bit_exact(tmp_path):
    """A 2-rank demo run (24 steps, no periodic checkpoint): SIGUSR1 to rank 1 alone makes both
    ranks save the same step and exit 75 (torchrun then exits 1, reporting the ranks' 75);
    resumed with ``--resume auto``, SIGTERM to the launcher (which passes it to each rank)
    does the same again. No rank is left running, no partial folder is left, and the last
    ``--resume auto`` ends with the metrics and final weights of the 2-rank run left alone, bit
    for bit."""
    import re

    from conftest import alive, start_child, torchrun_command, wait_until, worker_pids

    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train = ["-m", "grpo_fast", "train", "--steps", "24", "--save-every", "0", "--no-progress"]

    def logged() -> int:
        return len(read_metrics(cut)) if os.path.exists(os.path.join(cut, "metrics.jsonl")) else 0

    saved = []
    for target, name, resume in (("rank 1", "SIGUSR1", []), ("launcher", "SIGTERM", ["--resume", "auto"])):
        with start_child(torchrun_command(*train, "--output", cut, *resume), timeout=120) as launcher:
            start = logged()
            assert wait_until(lambda: logged() >= start + 3 or launcher.poll() is not None, 120)
            ranks = worker_pids(launcher.pid)
            assert sorted(ranks) == [0, 1], launcher.poll()
            if target == "rank 1":
                os.kill(ranks[1], signal.SIGUSR1)
            else:
                launcher.send_signal(signal.SIGTERM)
        said = launcher.stderr[-3000:]
        assert launcher.returncode != 0, said
        assert f"grpo-fast: preempted by {name}: checkpoint of step {logged()}" in launcher.stderr, said
        if target == "rank 1":
            assert re.search(r"exitcode\s*:\s*75", launcher.stderr), launcher.stderr[-3000:]
        assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, logged()) and logged() < 24
        assert not [d for d in os.listdir(os.path.join(cut, "checkpoints")) if d.startswith(".tmp")]
        assert not any(alive(pid) for pid in ranks.values())
        saved.append(logged())
    assert saved[1] > saved[0]
    with start_child(torchrun_command(*train, "--output", cut, "--resume", "auto"), timeout=180) as last:
        with start_child(torchrun_command(*train, "--output", full), timeout=180) as alone:
            pass
    assert last.returncode == alone.returncode == 0, (last.stderr[-2000:], alone.stderr[-2000:])
    assert without_timings(read_metrics(cut)) == without_timings(read_metrics(full))
    assert same_final_weights(cut, full)
