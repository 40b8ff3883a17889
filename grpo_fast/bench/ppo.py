"""PPO: the critic baseline that GRPO is measured against, as a strategy of GRPO's step.

    GRPOTrainer(config, strategy=PPO())       the GRPO trainer's step, the critic's strategy:

    for step:
        samples  <- the GRPO trainer's source: G samples per prompt, rewards
        prepare: GRPO's batch (micro-batches, reference log-probs), then
            values   <- value model on the padded batch's completion tokens, no grad  # (N, C)
            rewards  <- the sequence reward on each completion's last token          # (N, C)
            A, R     <- GAE(rewards, values; gamma, lambda); A whitened over active tokens
        for iteration in range(num_iterations):
            backward:
                policy: GRPO's own packed micro-batches, the loss on the completion tokens'
                        log-probs with A [N, C] (policy_loss, or the fused LM head)
                critic, per padded micro-batch of micro_batch_size rows:
                        clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2)
            optimizer steps: the critic's part with its own AdamW, then the policy's
        metrics: the critic's mean value

It serves the benchmarks (``grpo-fast bench memory``, ``benchmarks/demo_metrics.py``), not
training: GRPO's step knows it only as a :class:`~grpo_fast.trainer.update.strategy.Strategy`.

Choices, so that PPO and GRPO differ only in where the advantages come from: the same
rollout, reward path, policy loss and options (loss_type, clipping, micro-batching); the
KL to the reference is the loss term ``beta * kl`` of GRPO (as verl's ``use_kl_loss``),
not a per-token reward penalty. The value model is the policy's decoder (a copy: same
architecture, same starting weights) with a zero-initialised scalar head, trained by its
own optimizer with its own learning rate. A completion that no reward function scored is
masked out of both losses. Checkpoints hold the critic, its optimizer and LR schedule beside
the policy's (the part ``value``), so a PPO run resumes exactly as a GRPO run does; it runs
in one process (no torchrun).
"""

import copy
import dataclasses

import torch

from grpo_fast.trainer import distributed
from grpo_fast.trainer.rollout.engines import position_ids
from grpo_fast.trainer.rollout.samples import Samples
from grpo_fast.trainer.update.batch import StepBatch
from grpo_fast.trainer.update.optimization import adamw, lr_scheduler
from grpo_fast.trainer.update.strategy import Strategy, TrainedPart


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over completion tokens.

    Args:
        rewards: [N, C] per-token rewards.
        values: [N, C] value of the state before each token.
        mask: [N, C] 1 on a contiguous run of active tokens from t = 0; the value after the
            last active token is 0 (the episode ends there).

    Returns:
        ``(advantages [N, C], returns [N, C])``, both 0 where ``mask == 0``:
        ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
        ``R_t = A_t + V_t``.
    """
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards, values and mask must all be [N, C], got {list(rewards.shape)}, "
            f"{list(values.shape)}, {list(mask.shape)}"
        )
    m = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * m[:, t]
        next_value = values[:, t] * m[:, t]
        advantages[:, t] = next_advantage
    return advantages, advantages + values * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the active tokens of ``x`` [N, C]; 0 where ``mask == 0``."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = ((x - mean) ** 2 * m).sum() / (n - 1).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + eps) * m


def terminal_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [N, C]: each sequence's score [N] on its last active token, 0 elsewhere."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores.float() * (mask.sum(1) > 0)
    return rewards


def clipped_value_loss(values, old_values, returns, mask, cliprange: float):
    """Sum over active tokens of ``0.5 * max((V - R)^2, (V_clip - R)^2)``, V_clip within
    ``cliprange`` of the rollout's value; all [n, C]. Also returns the clipped fraction's count."""
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    m = mask.to(loss.dtype)
    with torch.no_grad():
        clip_count = (((clipped - returns) ** 2 > (values - returns) ** 2).to(m.dtype) * m).sum()
    return 0.5 * (loss * m).sum(), clip_count


@dataclasses.dataclass
class PPOBatch(StepBatch):
    """A step's batch with the critic's view: its values at sampling time and the GAE returns."""

    old_values: torch.Tensor | None = None  # [N, C]
    returns: torch.Tensor | None = None  # [N, C]


class ValueModel(torch.nn.Module):
    """The critic: a copy of the policy's decoder with a scalar head, V(state before token t)."""

    def __init__(self, policy):
        super().__init__()
        self.decoder = copy.deepcopy(policy.get_decoder())
        self.head = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # values start at 0: no arbitrary baseline at step 0
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
        """Values of the states that predict the completion tokens (the padded batch's last
        hidden states at those positions): [N, P + C] -> [N, C] float32."""
        C = num_completion_tokens
        out = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
        )
        return self.head(out.last_hidden_state[:, -C - 1 : -1]).squeeze(-1).float()


@dataclasses.dataclass
class PPO(Strategy):
    """PPO's advantages (GAE from a value model) and its critic, trained beside the policy.

    Args:
        gamma: discount over completion tokens, in [0, 1].
        lam: GAE lambda, in [0, 1].
        cliprange_value: the value may move at most this far from its rollout value (> 0).
        value_learning_rate: the critic's learning rate (> 0); None = the run's learning_rate.
        whiten_advantages: normalise the advantages over active tokens.
    """

    gamma: float = 1.0
    lam: float = 0.95
    cliprange_value: float = 0.2
    value_learning_rate: float | None = None
    whiten_advantages: bool = True
    # the critic as the trainer steps and checkpoints it (the part "value"), built by attach
    value: TrainedPart | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("gamma", "lam"):
            number = getattr(self, name)
            if not 0.0 <= number <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {number!r}")
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value!r}")
        if self.value_learning_rate is not None and not self.value_learning_rate > 0:
            raise ValueError(f"value_learning_rate must be > 0 or None, got {self.value_learning_rate!r}")

    def check(self, config, tools) -> None:
        if self.value is not None:  # a second trainer would take over the first one's critic
            raise ValueError("strategy: this PPO already trains a critic for another trainer; give each its own")
        if config.lora_r > 0:
            raise ValueError("the PPO baseline trains full models: lora_r must be 0")
        if config.max_staleness:
            raise ValueError("the PPO baseline samples synchronously: max_staleness must be 0")
        if config.tools or tools:  # its GAE walks the completion as the model's tokens alone
            raise ValueError("the PPO baseline runs single-turn rollouts: tools need GRPO's own strategy")
        if distributed.launched_by_torchrun():
            raise ValueError(
                "the PPO baseline runs in one process (its critic is not wrapped for DDP or FSDP2): start it without "
                "torchrun"
            )

    def attach(self, trainer) -> None:
        self.config, self.runtime = trainer.config, trainer.runtime
        model = ValueModel(trainer.policy).to(self.runtime.device).train()
        optimizer = adamw(model.parameters(), self.config.optim, self.value_learning_rate)
        self.value = TrainedPart(model, optimizer, lr_scheduler(optimizer, self.config.optim, self.config.rollout))

    def parts(self) -> dict:
        return {"value": self.value}

    @torch.no_grad()
    def rollout_values(self, samples: Samples) -> torch.Tensor:
        """The critic's values of the samples, [N, C], in micro-batches."""
        N, C = samples.completion_mask.shape
        step = self.config.micro_batch_size or N
        with self.runtime.autocast():
            return torch.cat(
                [
                    self.value.module(samples.input_ids[i : i + step], samples.attention_mask[i : i + step], C)
                    for i in range(0, N, step)
                ]
            )

    def prepare(self, batch: StepBatch) -> PPOBatch:
        """GRPO's batch with GAE advantages [N, C] from the critic's values (the group
        statistics are kept for logging). Unscored completions leave both losses (their mask
        is zeroed, and so are they in the token count)."""
        scores = batch.stats.rewards  # [N], the weighted reward sum, NaN where unscored
        mask = batch.completion_mask * (~scores.isnan()).unsqueeze(1)  # [N, C]
        old_values = self.rollout_values(batch.samples)  # [N, C]
        rewards = terminal_rewards(scores.nan_to_num(0.0), mask)  # [N, C]
        advantages, returns = gae(rewards, old_values, mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        fields = dict(
            vars(batch), completion_mask=mask, advantages=advantages, num_items=self.runtime.ranks.sum(mask.sum())
        )
        return PPOBatch(**fields, old_values=old_values, returns=returns)

    def backward(self, batch: PPOBatch) -> dict:
        """Backward of the clipped value loss, a token mean over the whole batch, in micro-batches."""
        num_items, samples = batch.num_items, batch.samples
        N, C = batch.completion_mask.shape
        micro = self.config.micro_batch_size or N
        loss, clipped = 0.0, 0.0
        for i in range(0, N, micro):
            rows = slice(i, min(i + micro, N))
            with self.runtime.autocast():
                values = self.value.module(samples.input_ids[rows], samples.attention_mask[rows], C)
            value_sum, clip_count = clipped_value_loss(
                values, batch.old_values[rows], batch.returns[rows], batch.completion_mask[rows], self.cliprange_value
            )
            (value_sum / num_items.clamp(min=1)).backward()
            loss += value_sum.item()
            clipped += clip_count.item()
        n = max(num_items.item(), 1)
        return dict(value_loss=loss / n, value_clip_frac=clipped / n)

    def metrics(self, batch: PPOBatch) -> dict:
        mask = batch.completion_mask
        return dict(value_mean=((batch.old_values * mask).sum() / mask.sum().clamp(min=1)).item())
