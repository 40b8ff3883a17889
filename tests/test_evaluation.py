"""Held-out evaluation: pass@k against enumeration, the eval metrics, the demo's held-out split,
evaluation during training, ``grpo-fast eval`` reproducing a run's last eval, bad input.

Runs use the demo's tiny model with a small batch (G=4, 16 completions, 4 steps).
"""

import itertools
import json
import os
import random

import pytest
import torch
from conftest import SMALL as SMALL_RUN
from conftest import write_jsonl

from grpo_fast.cli import main
from grpo_fast.tasks.arithmetic import HELD_OUT, build_dataset, held_out_rows
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run.evaluation import eval_metrics, pass_at_k
from grpo_fast.trainer.run.run_log import TIMING_KEYS, read_completions, read_metrics

SMALL = dict(SMALL_RUN, steps=4)
EVAL = dict(eval_every=2, eval_samples=4, log_completions_every=2)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()  # the CLI's demo sets one thread
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- pass@k
def test_pass_at_k_equals_enumerating_every_draw_of_k():
    """pass@k is the fraction of the C(n, k) draws of k of the n samples that hold a passing
    one: counted over every draw, exactly, for every n <= 9, c, k."""
    for n in range(1, 10):
        for c in range(n + 1):
            passed = [i < c for i in range(n)]
            for k in range(1, n + 1):
                draws = list(itertools.combinations(passed, k))
                truth = torch.tensor(sum(any(d) for d in draws) / len(draws), dtype=torch.float64)
                assert pass_at_k(n, c, k) == pytest.approx(truth.item(), abs=1e-14), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.0, 2, 1)])
def test_pass_at_k_bad_input(n, c, k):
    with pytest.raises(ValueError, match=r"pass_at_k needs ints 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)


def test_eval_metrics_of_a_reward_table():
    """3 prompts x 4 samples, two reward functions weighted 1 and 0.5, NaN = not scored: the
    combined reward is the weighted sum of the scored ones, a sample passes at >= 1.0, an
    unscored one never; the means leave NaN out."""
    r1 = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, float("nan"), 1.0, 0.2, 0.0]
    r2 = [0.0, 1.0, 1.0, float("nan"), 0.0, 0.0, 0.0, 1.0, float("nan"), 0.0, 0.0, 0.0]
    rewards = torch.tensor([r1, r2]).T
    got = eval_metrics(rewards, ["r1", "r2"], 4, pass_threshold=1.0, reward_weights=[1.0, 0.5])

    combined = [a + 0.5 * b if b == b else a for a, b in zip(r1, r2)]  # r2 NaN counts 0 ...
    combined[8] = float("nan")  # ... unless nothing scored the sample
    scored = [x for x in combined if x == x]
    passes = [sum(x >= 1.0 for x in combined[i : i + 4]) for i in (0, 4, 8)]  # [3, 0, 1]
    assert passes == [3, 0, 1]
    assert got["eval/reward_mean"] == pytest.approx(sum(scored) / len(scored))
    assert got["eval/rewards/r1"] == pytest.approx(sum(r1[:8] + r1[9:]) / 11)
    assert got["eval/rewards/r2"] == pytest.approx((sum(r2[:3]) + sum(r2[4:8]) + sum(r2[9:])) / 10)
    assert got["eval/pass@1"] == pytest.approx((3 / 4 + 0 + 1 / 4) / 3)
    assert got["eval/pass@4"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------- the demo's held-out split
def test_demo_training_rows_are_unchanged_and_the_held_out_sums_are_new():
    """The default demo draws its rows as it always did (its README curve stands); a run that
    evaluates on the held-out sums trains on rows that never show them, but shows each mirror b+a."""
    rng = random.Random(0)  # the demo's draw, written out
    draws = [(a, rng.randrange(10 - a)) for a in (rng.randrange(10) for _ in range(1000))]
    assert build_dataset(seed=0) == [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in draws]

    held = {row["prompt"] for row in held_out_rows()}
    assert len(held) == len(HELD_OUT) == 10 and all(a + b <= 9 for a, b in HELD_OUT)
    train = build_dataset(seed=0, hold_out=True)
    assert len(train) == 1000 and not held & {row["prompt"] for row in train}
    assert {f"{b}+{a}=" for a, b in HELD_OUT} <= {row["prompt"] for row in train}


def test_the_trainer_holds_out_only_when_it_evaluates_on_the_demo(tmp_path):
    plain = GRPOTrainer(GRPOConfig(**SMALL, output_dir=str(tmp_path / "a")))
    assert plain.rows == build_dataset(seed=0) and plain.evaluator is None
    evaluating = GRPOTrainer(GRPOConfig(**SMALL, **EVAL, output_dir=str(tmp_path / "b")))
    assert evaluating.rows == build_dataset(seed=0, hold_out=True)
    assert evaluating.evaluator.rows == held_out_rows()


# ---------------------------------------------------------------- during training, and grpo-fast eval
def test_evaluation_logs_every_k_steps_and_leaves_training_alone(tmp_path):
    """Eval metrics join the metrics lines of steps 2 and 4, completions.jsonl holds readable
    rows at those steps; the training's own numbers equal those of a run without evaluation
    (the held-out rows given as a file, so that both train on the same rows)."""
    eval_file = write_jsonl(tmp_path / "held.jsonl", held_out_rows())
    with_eval = GRPOTrainer(GRPOConfig(**SMALL, **EVAL, eval_dataset=eval_file, output_dir=str(tmp_path / "e")))
    history = with_eval.train()
    without = GRPOTrainer(GRPOConfig(**SMALL, log_completions_every=0, output_dir=str(tmp_path / "p"))).train()

    keys = {"eval/reward_mean", "eval/rewards/arithmetic_reward", "eval/pass@1", "eval/pass@4"}
    assert [sorted(keys & set(m)) for m in history] == [[], sorted(keys), [], sorted(keys)]
    assert read_metrics(str(tmp_path / "e")) == history
    for got, want in zip(history, without):
        assert {k: v for k, v in got.items() if k not in keys | set(TIMING_KEYS)} == {
            k: v for k, v in want.items() if k not in TIMING_KEYS
        }
    assert 0 <= history[-1]["eval/pass@1"] <= history[-1]["eval/pass@4"] <= 1

    rows = read_completions(str(tmp_path / "e"))
    assert [r["step"] for r in rows] == [2] * 16 + [4] * 16
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", "arithmetic_reward", "advantage"}
    assert all(isinstance(r["prompt"], str) and isinstance(r["completion"], str) for r in rows)
    assert not (tmp_path / "p" / "completions.jsonl").exists()


@pytest.mark.parametrize("generator", ["sampler", "hf"])
def test_grpo_fast_eval_of_final_reproduces_the_last_logged_eval(tmp_path, generator, capsys):
    """``grpo-fast eval --model <run>/final`` (the run's settings from its config.yaml) prints
    and writes exactly the eval numbers the run logged at its last step."""
    run = tmp_path / "run"
    history = GRPOTrainer(GRPOConfig(**SMALL, **EVAL, generator=generator, output_dir=str(run))).train()
    logged = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(run / "final"), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["metrics"] == logged
    assert result["eval_samples"] == 4 and result["generator"] == generator
    printed = capsys.readouterr().out
    assert "eval/pass@1" in printed and f"{logged['eval/reward_mean']:.4f}" in printed


def test_grpo_fast_eval_of_a_model_folder_with_a_dataset(tmp_path, capsys):
    """A plain model folder (no run around it) on a dataset file, with its flags."""
    from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "sums.jsonl", held_out_rows()[:3])
    args = ["eval", "--model", str(tmp_path / "model"), "--dataset", data, "--reward-funcs", "arithmetic"]
    out = tmp_path / "e.json"
    assert main([*args, "-n", "2", "--pass-threshold", "0.1", "--output", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert set(metrics) == {"eval/reward_mean", "eval/rewards/arithmetic_reward", "eval/pass@1", "eval/pass@2"}


# ---------------------------------------------------------------- bad input
def test_an_eval_dataset_without_the_answer_its_reward_needs(tmp_path):
    data = write_jsonl(tmp_path / "no_answer.jsonl", [{"prompt": "1+2="}])
    config = GRPOConfig(**SMALL, eval_every=2, eval_dataset=data, output_dir=str(tmp_path / "r"))
    with pytest.raises(ValueError, match=r"eval_dataset lacks what reward 'arithmetic_reward' needs; its columns are "):
        GRPOTrainer(config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(eval_every=5), r"eval_every=5 is larger than the run \(steps=4\)"),
        (dict(eval_every=-1), r"eval_every must be an int >= 0"),
        (dict(eval_every=2, eval_samples=0), r"eval_samples must be an int >= 1"),
        (dict(eval_every=2, eval_temperature=0.0), r"eval_temperature must be > 0"),
        (dict(eval_dataset="no/such.jsonl"), r"eval_dataset path 'no/such.jsonl' does not exist"),
        (dict(log_completions_every=-2), r"log_completions_every must be an int >= 0"),
    ],
)
def test_bad_eval_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**{**SMALL, **overrides}).validate()


def test_eval_every_on_a_dataset_needs_an_eval_dataset(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", held_out_rows())
    config = GRPOConfig(**SMALL, eval_every=2, dataset=data, reward_funcs=["arithmetic"], output_dir=str(tmp_path))
    only = r"eval needs eval_dataset .* only a built-in task or a reasoning-gym dataset has a held-out split"
    with pytest.raises(ValueError, match=only):
        GRPOTrainer(config)


def test_a_resumed_run_drops_the_completions_logged_after_its_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    config = dict(**SMALL, log_completions_every=1, save_every=2, output_dir=run)
    GRPOTrainer(GRPOConfig(**{**config, "steps": 3})).train()  # checkpoints at steps 2 and 3
    assert [r["step"] for r in read_completions(run)][::16] == [1, 2, 3]
    resumed = GRPOTrainer(GRPOConfig(**config))
    resumed.resume(os.path.join(run, "checkpoints", "step-000002"))
    assert [r["step"] for r in read_completions(run)][::16] == [1, 2]
    resumed.train()
    assert [r["step"] for r in read_completions(run)][::16] == [1, 2, 3, 4]


def test_completion_rows_spread_over_groups_and_average_per_token_advantages():
    """32 rows -> every 2nd row (16); a per-token advantage [N, C] (PPO's) is averaged over the
    completion's tokens; NaN rewards (not scored) become None."""
    from grpo_fast.outputs import GroupAdvantages
    from grpo_fast.trainer import Samples, StepBatch
    from grpo_fast.trainer.run.run_log import completion_rows

    N, C = 32, 3
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]).repeat(N // 2, 1)
    per_token = torch.arange(N * C, dtype=torch.float32).view(N, C)
    rewards = torch.rand(N, 1)
    rewards[2] = float("nan")
    samples = Samples(
        prompts=[f"p{i}" for i in range(N)],
        completions=[f"c{i}" for i in range(N)],
        columns={},
        input_ids=torch.zeros(N, 5, dtype=torch.long),
        attention_mask=torch.ones(N, 5, dtype=torch.long),
        completion_mask=mask,
        rewards=rewards,
    )
    batch = StepBatch(
        samples=samples,
        micro_batches=[],
        completion_mask=mask,
        scores=torch.empty(0, 3),
        stats=GroupAdvantages(per_token, rewards[:, 0], None, None, None),
        advantages=per_token,
        ref_logprobs=None,
        num_items=mask.sum(),
    )
    rows = completion_rows(batch, 7, ["r"])
    assert [r["prompt"] for r in rows] == [f"p{i}" for i in range(0, N, 2)]
    assert rows[1]["reward"] is None and rows[1]["r"] is None  # row 2
    for row, i in zip(rows, range(0, N, 2)):
        assert row["advantage"] == pytest.approx(((per_token[i] * mask[i]).sum() / mask[i].sum()).item())
        assert row["step"] == 7 and row["completion"] == f"c{i}"
