"""The PPO baseline (``grpo_fast/bench/ppo.py``, a strategy of GRPO's step): GAE and the clipped
value loss against hand-computed numbers, the critic's shape and independence from the policy,
its refusals, that PPO learns the demo task, its checkpoint keys, and that a killed PPO run
resumes bit-exact."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import one_thread

from grpo_fast.bench.ppo import PPO, ValueModel, clipped_value_loss, gae, masked_whiten, terminal_rewards
from grpo_fast.tasks.arithmetic import build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer, grpo
from grpo_fast.trainer.run import checkpoint as ckpt
from grpo_fast.trainer.run.run_log import TIMING_KEYS, read_metrics


def test_gae_hand_computed():
    # Row 0: three active tokens. Row 1: two active tokens; the masked third must not leak in.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 7.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.3, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.4 = 0.6; d1 = 0.9 * 0.4 - 0.2 = 0.16; d0 = 0.9 * 0.2 - 0.5 = -0.32
    #        A2 = 0.6, A1 = 0.16 + 0.72 * 0.6 = 0.592, A0 = -0.32 + 0.72 * 0.592 = 0.10624
    # row 1: d1 = 0.5 - 0.3 = 0.2 (the episode ends after t = 1); d0 = 0.9 * 0.3 - 0.1 = 0.17
    #        A1 = 0.2, A0 = 0.17 + 0.72 * 0.2 = 0.314
    expected = torch.tensor([[0.10624, 0.592, 0.6], [0.314, 0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, expected + values * mask, rtol=0, atol=1e-12)


def test_gae_monte_carlo_limit():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, the Monte Carlo advantage.
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    lengths = torch.tensor([[6], [3], [1], [0]])
    mask = (torch.arange(6).unsqueeze(0) < lengths).double()
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(advantages, (to_go - values) * mask, rtol=0, atol=1e-12)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"rewards, values and mask must all be \[N, C\]"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_terminal_rewards_and_whitening():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    rewards = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]))
    x = torch.tensor([[1.0, 3.0, 100.0], [2.0, 4.0, 5.0], [-50.0, 9.0, 9.0]])
    white = masked_whiten(x, mask)
    active = torch.tensor([1.0, 3.0, 2.0, 4.0, 5.0])
    expected = (active - active.mean()) / active.std()
    torch.testing.assert_close(white[mask.bool()], expected, rtol=1e-5, atol=1e-6)
    assert (white[~mask.bool()] == 0).all()


def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clip_count = clipped_value_loss(values, old, returns, mask, cliprange=0.2)
    # token 0: V = 1 moved 0.5 from 0.5 -> V_clip = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 (clipped wins)
    # token 1: V = 0, V_clip = 0; max(0, 0) = 0; token 2 is masked
    assert loss.item() == pytest.approx(0.5 * 1.69)
    assert clip_count.item() == 1
    loss.backward()
    torch.testing.assert_close(values.grad, torch.zeros(1, 3))  # the clipped branch has no gradient to V


def test_value_model_is_a_separate_copy_of_the_policy_decoder():
    policy = build_model(build_tokenizer())
    critic = ValueModel(policy)
    decoder_params = sum(p.numel() for p in policy.get_decoder().parameters())
    assert sum(p.numel() for p in critic.decoder.parameters()) == decoder_params
    assert critic.head.weight.shape == (1, policy.config.hidden_size)
    shared = {p.data_ptr() for p in policy.parameters()} & {p.data_ptr() for p in critic.parameters()}
    assert not shared
    ids = torch.randint(3, 15, (2, 7))
    values = critic(ids, torch.ones_like(ids), 3)
    assert values.shape == (2, 3) and values.dtype == torch.float32
    assert (values == 0).all()  # zero-initialised head


def test_ppo_options_are_validated():
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        PPO(gamma=1.5)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got -0.1"):
        PPO(lam=-0.1)
    with pytest.raises(ValueError, match="cliprange_value must be > 0, got 0.0"):
        PPO(cliprange_value=0.0)
    with pytest.raises(ValueError, match="value_learning_rate must be > 0 or None, got 0"):
        PPO(value_learning_rate=0)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lora_r=4), "trains full models: lora_r must be 0"),
        (dict(max_staleness=1), "samples synchronously: max_staleness must be 0"),
        (dict(tools=["calculator"]), "runs single-turn rollouts: tools need GRPO's own strategy"),
    ],
)
def test_ppo_refuses_runs_it_cannot_serve_before_anything_loads(monkeypatch, options, message):
    def started(*args, **kwargs):
        raise AssertionError("the run started before the strategy refused it")

    monkeypatch.setattr(grpo.Runtime, "start", started)
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(GRPOConfig(**options), strategy=PPO())


def test_a_strategy_must_be_one():
    with pytest.raises(TypeError, match="strategy must be a Strategy, got dict"):
        GRPOTrainer(GRPOConfig(), strategy={"gamma": 1.0})


def test_ppo_learns_the_demo_task(tmp_path):
    # The demo task with a batch and learning rate at which 20 steps show the rise; one thread:
    # the demo's matrices are 64 wide, and two threads synchronise every op.
    config = GRPOConfig(
        steps=20,
        batch_size=64,
        group_size=8,
        learning_rate=3e-3,
        beta=0.02,
        progress=False,
        save_every=0,
        output_dir=str(tmp_path),
    )
    trainer = GRPOTrainer(config, strategy=PPO())
    history = one_thread(lambda: [trainer.train_step() for _ in range(config.steps)])
    first = sum(m["reward_mean"] for m in history[:3]) / 3
    last = sum(m["reward_mean"] for m in history[-3:]) / 3
    assert last > first + 0.1, [round(m["reward_mean"], 3) for m in history]
    assert all(torch.isfinite(torch.tensor(m["value_loss"])) for m in history)
    assert history[-1]["value_mean"] > 0.05  # the critic has learned that rewards are positive


# A PPO run that a reward function pauses before step PAUSE + 1, after its checkpoint of step PAUSE.
KILLED_RUN = """
import functools, os, sys, time
import torch
from grpo_fast.tasks.arithmetic import arithmetic_reward
from grpo_fast.bench.ppo import PPO
from grpo_fast.trainer import GRPOConfig, GRPOTrainer

calls = []

@functools.wraps(arithmetic_reward)
def pausing(prompts, completions, **columns):
    calls.append(1)
    if len(calls) > int(os.environ["PAUSE"]):
        open(os.environ["PAUSED"], "w").close()
        time.sleep(600)
    return arithmetic_reward(prompts, completions, **columns)

torch.set_num_threads(int(os.environ["THREADS"]))
GRPOTrainer(GRPOConfig.from_yaml(sys.argv[1]), reward_funcs=[pausing], strategy=PPO(value_learning_rate=3e-3)).train()
"""


@pytest.mark.slow
def test_ppo_resumes_bit_exact_after_kill_9(tmp_path):
    """A PPO run killed with SIGKILL mid-run (in its 5th step), resumed from its step-4
    checkpoint, logs exactly the metrics of the uninterrupted run (all but timings): the
    critic, its AdamW state and LR schedule come back with the policy's."""
    options = dict(
        steps=6, save_every=2, keep_checkpoints=3, batch_size=16, group_size=4, max_new_tokens=3, progress=False
    )
    options.update(lr_schedule="cosine", num_iterations=2, beta=0.05)

    def ppo(output_dir: str) -> GRPOTrainer:
        return GRPOTrainer(GRPOConfig(**options, output_dir=output_dir), strategy=PPO(value_learning_rate=3e-3))

    full = ppo(str(tmp_path / "full")).train()
    assert len({m["value_loss"] for m in full}) > 1  # the compared critic metrics do vary

    cut = str(tmp_path / "cut")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(GRPOConfig(**options, output_dir=cut).to_dict()))
    paused = tmp_path / "paused"
    env = dict(os.environ, PAUSE="4", PAUSED=str(paused), THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tmp_path / "run.yaml")], env=env)
    try:
        deadline = time.time() + 240
        while not paused.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert paused.exists(), "the run never reached step 5"
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ckpt.latest_checkpoint(cut) == ckpt.checkpoint_path(cut, 4)

    resumed = ppo(cut)
    assert resumed.resume() == 4
    resumed.train()
    drop = set(TIMING_KEYS)
    assert [{k: v for k, v in m.items() if k not in drop} for m in read_metrics(cut)] == [
        {k: v for k, v in m.items() if k not in drop} for m in full
    ]


def test_ppo_refuses_a_checkpoint_without_its_critic(tmp_path):
    options = dict(steps=1, batch_size=8, group_size=4, max_new_tokens=2, progress=False, output_dir=str(tmp_path))
    GRPOTrainer(GRPOConfig(**options)).train()
    with pytest.raises(ckpt.CheckpointError, match="does not match the value model: missing"):
        GRPOTrainer(GRPOConfig(**options), strategy=PPO()).resume()


def test_ppo_checkpoints_keep_the_keys_ppo_trainer_wrote(tmp_path):
    """The critic is stored as PPOTrainer stored it before PPO became a strategy (the part
    "value": value.model.*, value.optimizer.*, value_scheduler in trainer.pt), so that its
    checkpoints still load; every stored tensor is the policy's or the critic's."""
    import torch.distributed.checkpoint as dcp

    options = dict(steps=1, batch_size=8, group_size=4, max_new_tokens=2, progress=False, output_dir=str(tmp_path))
    trainer = GRPOTrainer(GRPOConfig(**options), strategy=PPO())
    trainer.train()
    path = ckpt.latest_checkpoint(str(tmp_path))
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    critic = {name[len("value.model.") :] for name in stored if name.startswith("value.model.")}
    assert critic == {name for name, _ in trainer.strategy.value.module.named_parameters()}
    assert any(name.startswith("value.optimizer.state.") for name in stored)
    assert all(name.split(".")[0] in ("model", "optimizer", "value") for name in stored), sorted(stored)
    state = torch.load(os.path.join(path, ckpt.TRAINER_STATE), weights_only=False)
    assert state["value_scheduler"]["last_epoch"] == state["scheduler"]["last_epoch"] == 1


def test_one_ppo_trains_one_trainers_critic(tmp_path):
    """A second trainer handed the same PPO would take over the first one's critic: refused."""
    config = GRPOConfig(batch_size=8, group_size=4, max_new_tokens=2, progress=False, output_dir=str(tmp_path))
    strategy = PPO()
    GRPOTrainer(config, strategy=strategy)
    with pytest.raises(ValueError, match="this PPO already trains a critic for another trainer"):
        GRPOTrainer(config, strategy=strategy)
