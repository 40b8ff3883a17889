"""Held-out evaluation: n samples per prompt, the mean rewards, pass@1 and pass@n.

    rows      <- the eval dataset (or the demo's held-out sums)                 load_eval_rows
    samples   <- n completions of every prompt, sampled at eval_temperature,
                 prompt i keyed by its index i (the sampler's draws are then a function of
                 (seed, i, sample) and the weights alone)
    rewards   <- the run's reward functions; the combined reward is their weighted sum, as in
                 training (NaN where no function scored)
    metrics   <- eval/reward_mean, eval/rewards/<name>, eval/pass@1, eval/pass@n

A sample passes when its combined reward is at least ``pass_threshold``; pass@k is the
unbiased estimator of Chen et al. 2021 (:func:`pass_at_k`), averaged over prompts.

Under torchrun each rank samples a contiguous share of the prompts and the per-sample
rewards are gathered in prompt order, so every rank returns the numbers one process would.
The same :class:`Evaluator` serves the trainer (``--eval-every``) and ``grpo-fast eval``.
"""

import contextlib
import dataclasses
import math

import torch

from grpo_fast import group_advantages
from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
from grpo_fast.trainer.rollout.samples import RewardError, rollout, score
from grpo_fast.trainer.runtime import Runtime, set_seed


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, of
    which c passed, passes: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021), as the product
    ``prod_{i < k} (n - c - i) / (n - i)`` so that no binomial overflows."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)) or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs ints 0 <= c <= n and 1 <= k <= n, got n={n!r}, c={c!r}, k={k!r}")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def demo_holds_out(config) -> bool:
    """Whether ``config``'s run evaluates on the demo's held-out sums (and trains without them)."""
    return config.eval_every > 0 and config.dataset is None and config.eval_dataset is None


def load_eval_rows(config, tokenizer=None, tools: list | None = None) -> list:
    """The eval prompts of ``config``: its ``eval_dataset`` (read as ``dataset`` is), or, for
    a built-in task or a reasoning-gym dataset, its held-out rows. ``tools``: the schemas the
    prompts show."""
    from grpo_fast.tasks import load_rows
    from grpo_fast.tasks.reasoning_gym import is_reasoning_gym

    held_out = config.eval_dataset
    if held_out is None and config.dataset is not None:
        if not is_reasoning_gym(config.dataset):
            raise ValueError(
                "eval needs eval_dataset (a held-out file or folder of prompts): only a built-in task or a "
                f"reasoning-gym dataset has a held-out split of its own, and dataset={config.dataset!r} is given"
            )
        held_out = config.dataset  # its held-out rows come from a seed range of their own
    return load_rows(
        held_out,
        tokenizer=tokenizer,
        split=config.eval_split,
        task=config.task,
        held_out=True,
        tools=tools,
        **config.data.prompt_options(),
    )


def check_reward_columns(rows: list, reward_funcs: list, what: str = "eval_dataset", turn_loop=None) -> None:
    """ValueError naming the reward and the dataset's columns when a reward function cannot
    score the first row (an empty completion) with its columns, and those ``turn_loop`` adds
    (tool counts, the environment's rewards: ``TurnLoop.columns``): a missing answer column
    fails here rather than at the first evaluation."""
    row = rows[0]
    columns = {key: [value] for key, value in row.items() if key != "prompt"}
    columns.update(turn_loop.columns() if turn_loop is not None else {})
    for func in reward_funcs:
        try:
            score([func], [row.get("prompt", "")], [""], columns)
        except RewardError as exc:
            raise ValueError(
                f"{what} lacks what reward {getattr(func, '__name__', func)!r} needs; its columns are "
                f"{sorted(row)} ({exc.__cause__ or exc})"
            ) from exc


def eval_metrics(rewards: torch.Tensor, reward_names: list, n: int, pass_threshold: float, reward_weights=None) -> dict:
    """The eval metrics of rewards [M * n, K] (n samples of each of M prompts adjacent, K
    reward functions named ``reward_names``, combined with ``reward_weights`` as in training)."""
    combined = group_advantages(rewards, n, scale="none", reward_weights=reward_weights).rewards  # [M * n]
    scored = combined[~combined.isnan()]
    passed = (combined >= pass_threshold).view(-1, n).sum(1).tolist()  # [M] passing samples; NaN never passes
    out = {"eval/reward_mean": scored.mean().item() if len(scored) else None}
    for k, name in enumerate(reward_names):
        column = rewards[:, k]
        out[f"eval/rewards/{name}"] = None if column.isnan().all() else column.nanmean().item()
    for k in dict.fromkeys((1, n)):
        out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(passed)
    return out


@dataclasses.dataclass
class Evaluator:
    """Evaluates ``model`` on ``rows``: ``evaluator(version) -> {"eval/reward_mean": ..., ...}``.

    Args:
        model, tokenizer: the policy (as the trainer holds it) and its tokenizer.
        config: the run's :class:`~grpo_fast.trainer.GRPOConfig`: generator, seed,
            eval_samples, eval_temperature (None = temperature), eval_pass_threshold,
            reward_weights, batch_size (prompts per generation call: batch_size // eval_samples).
        rows: the eval prompt rows ``{"prompt": str, ...}``.
        reward_funcs, reward_names: the run's reward functions and their names.
        runtime: the device, the job's ranks and the precision (default: one process at
            float32 on the model's device).
        turn_loop: with tools or an environment, the rollouts' :class:`~grpo_fast.trainer.rollout.turns.TurnLoop`.
    """

    model: torch.nn.Module
    tokenizer: object
    config: object
    rows: list
    reward_funcs: list
    reward_names: list
    runtime: Runtime | None = None
    turn_loop: object = None

    def __post_init__(self):
        config = self.config
        if not self.rows:
            raise ValueError("the eval dataset has no rows")
        check_reward_columns(self.rows, self.reward_funcs, turn_loop=self.turn_loop)
        self.runtime = self.runtime or Runtime.of(self.model)
        temperature = config.temperature if config.eval_temperature is None else config.eval_temperature
        settings = EngineSettings.of(config, temperature=temperature)
        self.generator = make_generator(config.generator, self.model, self.tokenizer, settings, self.runtime)

    def __call__(self, version: int = 0) -> dict:
        """The eval metrics of the model with its weights at ``version`` (optimizer steps; an
        engine with its own copy of them, vllm, reloads them when they changed)."""
        self.generator.publish(version)
        config, ranks, n = self.config, self.runtime.ranks, self.config.eval_samples
        M = len(self.rows)
        first, stop = ranks.data_rank * M // ranks.data_size, (ranks.data_rank + 1) * M // ranks.data_size
        chunk = max(1, config.batch_size // n)
        parts = [torch.empty(0, len(self.reward_funcs))]
        with self._random_state():
            for start in range(first, stop, chunk):
                keys = list(range(start, min(start + chunk, stop)))
                rows = [self.rows[i] for i in keys]
                samples = rollout(self.generator, rows, keys, self.reward_funcs, group_size=n, turns=self.turn_loop)
                parts.append(samples.rewards)
        rewards, _ = ranks.gather_rows(torch.cat(parts))  # [M * n, K], every prompt's samples in order
        return eval_metrics(rewards, self.reward_names, n, config.eval_pass_threshold, config.reward_weights)

    def _random_state(self):
        """The Hugging Face engine draws from torch's global generator: it is seeded with the
        run's seed for the evaluation and restored after, so the evaluation neither depends on
        nor moves the training's random state."""
        if self.config.generator != "hf":
            return contextlib.nullcontext()
        return _seeded(self.config.seed + self.runtime.ranks.data_rank, self.runtime.device)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def evaluate_model(config) -> dict:
    """``grpo-fast eval``: the eval metrics of the model folder ``config.model`` on
    ``config``'s eval rows, with its reward functions and eval_* options (under torchrun every
    rank its share of the prompts; every rank returns the numbers)."""
    from grpo_fast.environments import load_environment
    from grpo_fast.tasks import resolve_rewards
    from grpo_fast.tools import resolve_tools
    from grpo_fast.trainer.checks import check_model_source
    from grpo_fast.trainer.model.build import load_model_and_tokenizer
    from grpo_fast.trainer.rollout.turns import turn_loop

    tools, environment = resolve_tools(config.tools), load_environment(config.environment)
    check_model_source(config)
    set_seed(config.seed)
    runtime = Runtime.start(config.devices, config.precision)
    runtime.log(config.precision, "eval")
    model, tokenizer = load_model_and_tokenizer(config, runtime.flash_attention())
    loop = turn_loop(tokenizer, tools, environment, config)
    funcs, names = resolve_rewards(config.reward_funcs, config.dataset, config.task, environment is not None)
    if environment is None:
        rows = load_eval_rows(config, tokenizer, [tool.schema for tool in tools] or None)
    else:  # the episodes' reset gives each prompt
        rows = load_eval_rows(config)
    return Evaluator(model.to(runtime.device), tokenizer, config, rows, funcs, names, runtime, loop)()
