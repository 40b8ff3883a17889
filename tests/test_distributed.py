"""Many processes on torchrun (gloo, CPU): the same result at any world size.

- gradients: one fixed rollout batch, world size 1 against 2, DDP and FSDP2, every loss type,
  uneven and empty ranks, the fused LM head, GSPO, batch-scaled advantages, LoRA with
  gradient checkpointing; dynamic sampling; an FSDP2 checkpoint resumed by one plain process
- ``torchrun -m grpo_fast train``: learns as one process does, row for row at first; a rank
  killed mid-run stops the job, ``--resume`` continues bit-exact, one process resumes too;
  held-out evaluation: the run's, and ``grpo-fast eval``'s on 2 ranks, equal one process's
- a rank's failing reward function, or a rank that hangs, stops the job with that error

Each torchrun job starts two fresh interpreters on the 2-core machine (about 10 s each), so
a job checks all it can, and the one-process numbers it is compared with are computed in this
process while it runs.
"""

import glob
import os
import shutil
import signal
import time

import _distributed_worker as worker
import pytest
import torch
from conftest import (
    TESTS,
    alive,
    assert_rows_close,
    one_thread,
    rel_err,
    run_child,
    start_child,
    torchrun_command,
    wait_until,
    without_timings,
    worker_pids,
    write_jsonl,
)

from grpo_fast.spec import LOSS_TYPES
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.choices import PARALLEL
from grpo_fast.trainer.run import checkpoint as ckpt
from grpo_fast.trainer.run.run_log import read_metrics, tenth_means

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- gradients
def gradient_cases() -> list:
    """Every loss type under both parallelisms (float64, micro-batches cut by a token budget so
    that the ranks hold different numbers), then the regimes that change what crosses ranks."""
    cases = []
    for parallel in PARALLEL:

        def case(batch="float64", split=(8, 8), **config):
            config = dict(max_tokens_per_micro_batch=24, parallel=parallel, num_iterations=2, **config)
            dtype = torch.float64 if batch == "float64" else torch.float32
            cases.append(dict(batch=batch, dtype=dtype, split=list(split), config=config))

        for loss_type in LOSS_TYPES:
            case(loss_type=loss_type, eps_high=5.0 if loss_type == "cispo" else None)
        case(batch="float32", loss_type="grpo")
        case(batch="float32", loss_type="dapo")
        case(split=(12, 4), loss_type="dapo")  # uneven ranks, as dynamic sampling leaves them
        case(split=(16, 0), loss_type="grpo")  # a rank with no rows runs fillers only
        case(fused_linear=True)
        case(importance_sampling="sequence")
        case(advantage_scale="batch")  # the batch std is the global batch's
        case(lora_r=4, gradient_checkpointing=True)
        case(shared_prefix=False)  # every row whole (the cases above share each group's prompt)
        # both ranks one sequence group: each runs the whole batch's rows on half their tokens
        case(split=(16,), sequence_parallel=2)
        # and with one layer input in two kept (checkpoint_every): the all-to-alls run in the refill
        # too; the MLPs in tiles (mlp_tile_tokens) deliver their weights' gradients to DDP's and
        # FSDP2's hooks once, summed over the tiles
        case(
            split=(16,),
            sequence_parallel=2,
            loss_type="dapo",
            fused_linear=True,
            gradient_checkpointing=True,
            checkpoint_every=2,
            mlp_tile_tokens=5,
        )
    return cases


def one_process(case: dict) -> dict:
    """``case`` as one process runs it: no parallelism of any kind (it would change nothing)."""
    config = {k: v for k, v in case["config"].items() if k not in ("parallel", "sequence_parallel")}
    return dict(case, config=config)


def test_world_size_2_gives_the_gradients_of_world_size_1(tmp_path, float64_norms):
    """Rank r takes rows [sum(split[:r]), ...) of one fixed batch; the gathered gradient of a
    pass with old log-probs (the proximal policy's, off the current one so that ratios clip)
    equals the one-process gradient of the whole batch (float64 to 1e-10, float32 to 1e-5), and
    so do the pass's loss and metrics. The same job also checks the world-size validation, a
    dynamic-sampling step against one process's, and resumes a 2-rank FSDP2 LoRA checkpoint in
    this (plain) process. The one-process numbers are computed while the job runs."""
    fixed = {
        name: worker.fixed_batch(worker.trainer_for(dict(dtype=dtype), str(tmp_path)))
        for name, dtype in (("float64", torch.float64), ("float32", torch.float32))
    }
    cases = gradient_cases()
    job, out, lora_dir = tmp_path / "job.pt", tmp_path / "out.pt", str(tmp_path / "lora")
    torch.save(dict(cases=cases, fixed=fixed, lora_dir=lora_dir), job)
    with start_child(torchrun_command(os.path.join(TESTS, "_distributed_worker.py"), str(job), str(out))) as proc:
        wants = {}  # world size 1: the parallelism makes no difference
        for case in map(one_process, cases):
            key = (case["batch"], repr(sorted(case["config"].items())))
            if key not in wants:
                wants[key] = worker.case_gradients(case, fixed[case["batch"]], str(tmp_path))
        one = worker.dynamic_sampling_step(str(tmp_path))
        alone = worker.lora_run("ddp", str(tmp_path / "lora_alone"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    two = torch.load(out, weights_only=False)

    for case, got in zip(cases, two["cases"]):
        single = one_process(case)
        want = wants[(single["batch"], repr(sorted(single["config"].items())))]
        tolerance = 1e-10 if case["batch"] == "float64" else 1e-5
        assert want["grads"].norm() > 0
        assert rel_err(got["grads"], want["grads"]) < tolerance, case
        assert got["sums"]["loss"] == pytest.approx(want["sums"]["loss"], rel=tolerance, abs=1e-12), case
        for key, value in want["sums"].items():  # float32 metrics
            assert got["sums"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (case, key)
    clipped = [(c["sums"]["clip_ratio_low"] or 0) + (c["sums"]["clip_ratio_high"] or 0) for c in two["cases"]]
    assert max(clipped) > 0  # the old log-probs reached the loss: ratios left the trust region

    assert "batch_size=12 gives 3 prompts per step" in two["rank_errors"]
    assert "divisible by the world size 2" in two["rank_errors"]
    assert "sequence_parallel=3 must divide the world size 2" in two["sequence_error"]

    assert one["groups_dropped"] >= 1 and one["sampling_rounds"] >= 2
    assert_rows_close([two["dynamic"]], [one], rel=1e-5)

    # The 2-rank FSDP2 run wrote sharded checkpoints; this process, without a process group,
    # resumes the last one and runs a third step. Its first two steps match one process's.
    assert_rows_close(two["lora"], alone, rel=1e-4)
    config = dict(lora_r=4, gradient_checkpointing=True, steps=3, save_every=1)
    resumed = worker.trainer_for(dict(config=config), lora_dir)
    assert resumed.resume() == 2
    assert [m["step"] for m in resumed.train()] == [1, 2, 3]
    assert os.path.isfile(os.path.join(lora_dir, "final", "adapter_model.safetensors"))


# ---------------------------------------------------------------- the command line
DEMO = [
    "--steps",
    "40",
    "--save-every",
    "10",
    "--keep-checkpoints",
    "3",
    "--no-progress",
    "--reward-funcs",
    "_distributed_worker:arithmetic_or_pause",
]


def train_command(output: str, *args) -> list:
    return torchrun_command("-m", "grpo_fast", "train", "--output", output, *DEMO, *args)


def test_torchrun_learns_like_one_process_resumes_after_a_killed_rank_and_evaluates_as_one(tmp_path):
    """One 2-rank run of ``torchrun --nproc-per-node 2 -m grpo_fast train`` on the demo (40
    steps, a checkpoint every 10), taken further at each stage; the one-process runs it is
    compared with run in this process while a job runs.

    Learns as one process: the samples are the same as one process's, so its first 20 rows
    equal one process's to 1e-4. Gradients summed over ranks round differently and AdamW's
    normalisation amplifies the difference through the updates: past step 20 the two runs
    drift apart (measured: kl 0.4% apart at step 23, one sample different at step 30,
    grad_norm 10% at step 35), so later rows are not compared across world sizes. The reward
    rises.

    A killed rank: a copy of the run cut back to its step-20 checkpoint is resumed on 2 ranks,
    and its rank 1 SIGKILLed at step 33 (its reward function stops there): the job exits
    non-zero, no process is left, the run's own step-30 checkpoint is the latest and whole.
    ``--resume`` on 2 ranks continues from step 30 bit-exact against the uninterrupted run; one
    plain process resumes the step-20 checkpoint (resharded) and continues as the 2-rank run
    did: its last 20 rows equal the run's to 1e-4 (measured 1.4e-5, grad_norm). (Against the
    one-process run from scratch they drift as the 2-rank run does: kl 0.4% apart at step 23.)

    Held-out evaluation: the 2-rank resume evaluates at its end on 7 prompts (ranks take 3 and
    4, sampled in chunks of 128 // 64 = 2); it logs the numbers that ``grpo-fast eval`` of its
    final/ gives on 2 ranks and on one process, exactly; of its two ranks only rank 0 wrote
    TensorBoard events."""
    import json

    from grpo_fast.cli import main
    from grpo_fast.tasks.arithmetic import held_out_rows

    full, cut, cut_alone = str(tmp_path / "full"), str(tmp_path / "cut"), str(tmp_path / "cut_alone")
    config = GRPOConfig(
        steps=40, save_every=0, progress=False, reward_funcs=DEMO[-1:], output_dir=str(tmp_path / "one")
    )
    with start_child(train_command(full)) as proc:
        alone = one_thread(GRPOTrainer(config).train)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = read_metrics(full)
    assert [m["step"] for m in rows] == list(range(1, 41))
    assert_rows_close(rows[:20], alone[:20], rel=1e-4)
    first, last = tenth_means(rows)
    assert last - first >= 0.1

    shutil.copytree(full, cut, ignore=shutil.ignore_patterns("step-000030", "step-000040", "final"))
    assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, 20)
    shutil.copytree(cut, cut_alone)
    paused = tmp_path / "paused"
    resume = torchrun_command("-m", "grpo_fast", "train", "--resume", "--output", cut, "--no-progress")
    with start_child(resume, timeout=120, GRPO_FAST_TEST_PAUSE="12", GRPO_FAST_TEST_PAUSED=str(paused)) as launcher:
        # one process resumes the step-20 checkpoint meanwhile
        assert one_thread(lambda: main(["train", "--resume", "--output", cut_alone, "--no-progress"])) == 0
        assert wait_until(lambda: paused.exists() or launcher.poll() is not None, 240)
        assert paused.exists(), f"rank 1 never reached step 33: {launcher.poll()}"
        ranks = worker_pids(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        start = time.time()
        launcher.wait(timeout=120)
        stopped = time.time()
    # The job stopped because of the killed rank, not at the end of its 40 steps.
    assert launcher.returncode != 0, f"exit {launcher.returncode} {time.time() - start:.0f} s after the kill"
    assert stopped - start < 30  # docs/reliability.md's bound for a dead partner
    time.sleep(1)
    assert not any(alive(pid) for pid in ranks.values())
    assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, 30)
    assert not [d for d in os.listdir(os.path.join(cut, "checkpoints")) if d.startswith(".tmp")]
    resumed_alone = read_metrics(cut_alone)
    assert [m["step"] for m in resumed_alone] == list(range(1, 41))
    assert without_timings(resumed_alone[:20]) == without_timings(rows[:20])
    assert_rows_close(resumed_alone[20:], rows[20:], rel=1e-4)

    data = write_jsonl(tmp_path / "held.jsonl", held_out_rows()[:7])
    evaluation = ["--eval-dataset", str(data), "--eval-samples", "64", "--report-to", "tensorboard"]
    proc = run_child(resume + evaluation)
    assert proc.returncode == 0, proc.stderr[-5000:]
    resumed = read_metrics(cut)
    logged = {k: resumed[-1].pop(k) for k in list(resumed[-1]) if k.startswith("eval/")}
    assert without_timings(resumed) == without_timings(rows)
    assert len(glob.glob(os.path.join(cut, "tensorboard", "events.*"))) == 1

    final, two, one = os.path.join(cut, "final"), tmp_path / "two.json", tmp_path / "one.json"
    with start_child(torchrun_command("-m", "grpo_fast", "eval", "--model", final, "--output", str(two))) as proc:
        assert main(["eval", "--model", final, "--output", str(one)]) == 0
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert json.loads(two.read_text())["metrics"] == json.loads(one.read_text())["metrics"] == logged
    assert 0 < logged["eval/reward_mean"] < 1


def test_a_failing_reward_on_one_rank_stops_the_job_with_its_error(tmp_path):
    proc = run_child(train_command(str(tmp_path), "--reward-funcs", "_distributed_worker:fails_on_rank_1"), timeout=180)
    assert proc.returncode != 0
    assert "grpo-fast: error (rank 1): reward function 'fails_on_rank_1' raised KeyError" in proc.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_hanging_rank_times_out_the_job(tmp_path):
    """Rank 1 sleeps in its reward function; rank 0 waits for it in a collective for
    --collective-timeout-s seconds, fails, and torchrun stops the job."""
    start = time.time()
    args = ["--reward-funcs", "_distributed_worker:hangs_on_rank_1", "--collective-timeout-s", "5"]
    proc = run_child(train_command(str(tmp_path), *args), timeout=180)
    # The 5 s collective timeout applied: rank 0 failed on it, before the stalled rank woke.
    assert proc.returncode != 0, f"exit {proc.returncode} after {time.time() - start:.0f} s"
    assert "Timed out waiting 5000ms" in proc.stderr, proc.stderr[-3000:]


def test_shutdown_frees_each_ddp_reducer_before_the_process_group(tmp_path):
    """The end of a run: a DDP reducer owns the gloo group from C++ and must not be its last
    owner (its destructor would join gloo's threads holding the GIL), so shutdown() frees every
    live replica's reducer and logger while the group exists, then destroys the group."""
    import torch.distributed as dist

    from grpo_fast.trainer import distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    runtime = type("Runtime", (), {"device": torch.device("cpu")})()
    replica = distributed.wrap(torch.nn.Linear(4, 2), "ddp", runtime)
    replica(torch.ones(3, 4)).sum().backward()  # a reduction: the reducer has run
    seen = []
    original = dist.destroy_process_group
    try:
        dist.destroy_process_group = lambda: (seen.append(replica.reducer), original())[1]
        distributed.shutdown()
    finally:
        dist.destroy_process_group = original
    assert seen == [None] and replica.logger is None and not dist.is_initialized()


def test_compile_generation_under_fsdp_is_refused_before_the_model_loads(tmp_path):
    """A CUDA graph replays fixed weight addresses; FSDP2 gathers the weights anew each rollout."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = GRPOConfig(compile_generation=True, parallel="fsdp", device="cpu", output_dir=str(tmp_path / "run"))
        with pytest.raises(ValueError, match="compile_generation replays a CUDA graph .* use parallel='ddp'"):
            GRPOTrainer(config)
    finally:
        dist.destroy_process_group()


def test_under_torchrun_each_rank_has_its_own_gpu_and_ppo_is_refused(monkeypatch):
    from grpo_fast.bench.ppo import PPO
    from grpo_fast.trainer.distributed import resolve_device

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:0' under torchrun: .* \(here cuda:1\); pass device='cuda'"):
        resolve_device("cuda:0")
    # refused before a process group is joined or a model wrapped
    with pytest.raises(ValueError, match="the PPO baseline runs in one process"):
        GRPOTrainer(GRPOConfig(device="cpu"), strategy=PPO())
