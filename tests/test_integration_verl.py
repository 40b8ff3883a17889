"""grpo_fast.integrations.verl against verl's own functions on the same inputs.

The registered policy losses against verl's ``vanilla``, ``gspo``, ``cispo`` and ``sapo``
(loss, gradient of the log-probs, metrics) for every ``loss_agg_mode``, with and without the
global batch counts and rollout weights; the fused LM head against verl's
``FusedLinearForPPO`` (values and gradients of hidden states and weight, through the
log-probs and the entropy). The inputs carry every regime: both clip sides and both advantage
signs, log-ratios beyond verl's clamp at +-20, padded and empty rows.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import max_err, rel_err

pytest.importorskip(
    "verl", reason="verl installs with --no-deps: pip install --no-deps verl==0.9.1 (README's test command)"
)

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.experimental import torch_functional as verl_fused  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

from grpo_fast.integrations import verl as integration  # noqa: E402

B, T = 6, 7
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
LOSSES = ["vanilla", "gspo", "cispo", "sapo"]


def actor_config(global_batch: bool):
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=2.5,
        tau_pos=0.9,
        tau_neg=1.2,
    )
    if global_batch:  # this rank's share of a 2-rank batch
        config.global_batch_info.update(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=9)
    return config


def make_inputs(loss: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=g) * 3
    old = log_prob + 0.4 * torch.randn(B, T, generator=g)
    if loss == "gspo":  # sequence ratios off 1 both ways
        old += 0.4 * torch.randn(B, 1, generator=g)
    else:  # beyond verl's log-ratio clamp at +-20, both ways
        old[0, 1], old[3, 2] = log_prob[0, 1] - 25, log_prob[3, 2] + 25
    advantages = (torch.randn(B, 1, generator=g) + 0.2).expand(B, T).contiguous()
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    mask[4, :] = 0
    return log_prob, old, advantages, mask


def run(fn, log_prob, old, advantages, mask, mode, config, weights):
    x = log_prob.clone().requires_grad_()
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=x,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("weighted", [False, True], ids=["no-rollout-weights", "rollout-weights"])
@pytest.mark.parametrize("global_batch", [False, True], ids=["local", "global-batch-info"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", LOSSES)
def test_policy_losses_match_verl(loss, mode, global_batch, weighted):
    log_prob, old, advantages, mask = make_inputs(loss)
    config = actor_config(global_batch)
    weights = None
    if weighted:  # per sequence for gspo (per token runs verl's own: see the next test)
        weights = torch.rand(B, 1 if loss == "gspo" else T, generator=torch.Generator().manual_seed(1)) + 0.5
        weights = weights.expand(B, T).contiguous()
    expected = run(core_algos.get_policy_loss_fn(loss), log_prob, old, advantages, mask, mode, config, weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back to verl's function
        got = run(
            core_algos.get_policy_loss_fn(f"grpo_fast_{loss}"), log_prob, old, advantages, mask, mode, config, weights
        )
    assert float(got[0]) == pytest.approx(float(expected[0]), rel=1e-5, abs=1e-7)
    assert rel_err(got[1], expected[1]) < 1e-5
    assert got[2] == pytest.approx(expected[2], rel=1e-5, abs=1e-7)
    if loss != "sapo":  # the regimes are there: some tokens clipped, some not
        assert 0 < expected[2]["actor/pg_clipfrac"] < 1


def test_gspo_falls_back_to_verl_where_it_differs():
    """Rollout weights that vary within a sequence, or a sequence log-ratio above verl's cap of 10:
    verl's own gspo computes the batch, with one warning."""
    log_prob, old, advantages, mask = make_inputs("gspo")
    config = actor_config(False)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) + 0.5
    for w, old_in in ((weights, old), (None, old - 12 * torch.eye(B, T)[:, :1].expand(B, T))):
        expected = run(
            core_algos.get_policy_loss_fn("gspo"), log_prob, old_in, advantages, mask, "token-mean", config, w
        )
        with pytest.warns(UserWarning, match="verl's own gspo"):
            got = run(integration.policy_loss_gspo, log_prob, old_in, advantages, mask, "token-mean", config, w)
        assert float(got[0]) == float(expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("mode", MODES)
def test_token_weights_are_verl_aggregation(mode):
    """agg_loss is linear in the per-token losses: its gradient is our token weights."""
    _, _, _, mask = make_inputs("vanilla")
    loss_mat = torch.randn(B, T, requires_grad=True)
    for info in ({}, actor_config(True).global_batch_info):
        core_algos.agg_loss(loss_mat, mask, mode, **info).backward()
        assert torch.allclose(integration.verl_token_weights(mask, mode, **info), loss_mat.grad, rtol=1e-6, atol=0)
        loss_mat.grad = None


@pytest.mark.parametrize("shape", [(3, 5), (11,)], ids=["3d", "2d"])
@pytest.mark.parametrize("grads", ["logp", "logp+entropy", "entropy"])
def test_fused_linear_for_ppo_matches_verl(shape, grads):
    g = torch.Generator().manual_seed(3)
    H, V = 16, 203  # V not a multiple of any chunk
    hidden = torch.randn(*shape, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, shape, generator=g)
    upstream_logp, upstream_entropy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    def forward_backward(module):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = module(h, w, ids, temperature=0.7)
        total = 0
        if "logp" in grads:
            total = total + (logp * upstream_logp).sum()
        if "entropy" in grads:
            total = total + (entropy * upstream_entropy).sum()
        total.backward()
        return logp.detach(), entropy.detach(), h.grad, w.grad

    expected = forward_backward(integration.VERL_FUSED_LINEAR_FOR_PPO(chunk_size=4))
    got = forward_backward(integration.FusedLinearForPPO(chunk_size=4))
    for name, a, b in zip(("logp", "entropy", "grad hidden", "grad weight"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 1e-5 and max_err(a, b) < 1e-5, name


@pytest.mark.slow
def test_verl_imports_the_integration_in_its_workers():
    """VERL_USE_EXTERNAL_MODULES (what every verl process reads on import) registers the losses and
    replaces FusedLinearForPPO, which verl's model forwards import from torch_functional."""
    code = (
        "from verl.trainer.ppo import core_algos\n"
        "from verl.utils.experimental.torch_functional import FusedLinearForPPO\n"
        "names = {'grpo_fast_vanilla', 'grpo_fast_gspo', 'grpo_fast_cispo', 'grpo_fast_sapo'}\n"
        "assert names <= set(core_algos.POLICY_LOSS_REGISTRY)\n"
        "assert FusedLinearForPPO.__module__ == 'grpo_fast.integrations.verl', FusedLinearForPPO\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "grpo_fast.integrations.verl"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_verl_fused_module_is_replaced():
    assert verl_fused.FusedLinearForPPO is integration.FusedLinearForPPO
    assert integration.VERL_FUSED_LINEAR_FOR_PPO is not integration.FusedLinearForPPO
