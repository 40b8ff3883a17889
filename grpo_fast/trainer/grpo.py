"""GRPOTrainer: the lean GRPO loop.

    for step:                                            # train_step, a template:
        rows     <- next batch_size / G prompts (shuffled each epoch, resumable by position)
        rollout  <- G samples per prompt (a generation engine), rewards [N, K]; with
                    dynamic sampling, groups with equal rewards dropped and more prompts
                    sampled (up to max_sampling_rounds); reference log-probs (beta != 0)
        advantages <- group advantages of the rewards                compute_advantages
        for iteration in range(num_iterations):         # one optimizer step each
            for packed micro-batch (a token budget): loss <- the loss on the completion
                tokens' log-probs; backward                          accumulate_gradients
            clip grad norm; AdamW step; LR schedule step             optimizer_step
        log metrics.jsonl; checkpoint every save_every steps

The PPO baseline (``ppo.py``) overrides the three named steps. Choices: the loss's options
are one :class:`grpo_fast.LossConfig` built once from the config; its temperature is the
sampling temperature (the log-probs are those of the distribution that sampled). Every
forward runs on packed sequences (``packing.py``: no padding computed, the LM head only at
completion positions), in micro-batches cut by a token budget so that each does similar
work, weighted by the loss spec so that the accumulated gradient equals the full-batch
gradient for every loss type. The old log-probs (num_iterations > 1) are the first pass's
own: it runs at the sampling weights, so no separate forward computes them. On CUDA the
forward passes run under bf16 autocast while weights and optimizer state stay float32.
"""

import copy
import dataclasses
import math
import os
import random
import resource
import shutil
import time

import numpy as np
import torch

from grpo_fast import fused_linear_grpo_loss, fused_linear_token_logprobs, group_advantages, policy_loss, token_logprobs
from grpo_fast.outputs import GroupAdvantages
from grpo_fast.tasks import DATASET_REWARDS, DEMO_REWARDS, get_reward_function, load_rows
from grpo_fast.trainer import checkpoint as ckpt
from grpo_fast.trainer import run_log
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.generators import make_generator
from grpo_fast.trainer.packing import (
    Packed,
    flash_attention_available,
    micro_batches,
    pack,
    packed_hidden,
    packed_logits,
    to_grid,
)
from grpo_fast.trainer.rollout import (
    Rollout,
    autocast,
    concat_rollouts,
    groups_with_signal,
    packed_completion_logprobs,
    reference_context,
    rollout,
    select_groups,
)

# The loss and the loss metrics that each backward pass logs (LossOutput's fields but ratio_mean).
PASS_METRICS = ("loss", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy")


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global generators (as transformers' ``set_seed``)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_model_and_tokenizer(config: GRPOConfig, flash_attention: bool = False):
    """The policy and tokenizer: from ``config.model`` (a local path) or the built-in demo.
    ``flash_attention`` loads the model with ``flash_attention_2``, whose varlen kernels run
    the packed forwards (see ``packing.py``)."""
    if config.model is None:
        from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        return build_model(tokenizer, seed=config.seed), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    attention = dict(attn_implementation="flash_attention_2") if flash_attention else {}
    model = AutoModelForCausalLM.from_pretrained(config.model, local_files_only=True, dtype=torch.float32, **attention)
    return model, tokenizer


class GRPOTrainer:
    """Trains ``model`` (or the one ``config`` names) with GRPO on ``rows`` (or ``config.dataset``).

    The trainer seeds the global random generators with ``config.seed`` (sampling with the
    Hugging Face engine draws from torch's); it changes no other state of its caller: the
    tokenizer, thread counts and plotting backend are left as they were.

    Args:
        config: the run (see :class:`GRPOConfig`).
        model, tokenizer: an already loaded policy and tokenizer (default: from ``config``).
        rows: prompt rows ``{"prompt": str, ...}`` (default: from ``config``).
        reward_funcs: callables or names (default: ``config.reward_funcs``, else the task's).
    """

    def __init__(self, config: GRPOConfig, *, model=None, tokenizer=None, rows=None, reward_funcs=None):
        config.validate()
        self.config = config
        self.loss_config = config.loss_config()
        seed_everything(config.seed)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.bf16 = config.precision == "bf16" or (config.precision == "auto" and self.device.type == "cuda")
        if model is None:
            model, tokenizer = load_model_and_tokenizer(config, flash_attention_available(self.device, self.bf16))
        elif tokenizer is None:
            raise ValueError("a model passed to GRPOTrainer needs its tokenizer")
        self.tokenizer = tokenizer
        self.policy = self._prepare_policy(model)
        self.reference = self._make_reference()
        self.rows = rows if rows is not None else self._load_rows()
        self.reward_funcs, self.reward_names = self._resolve_rewards(reward_funcs)
        self.generator = make_generator(config.generator, self.policy, tokenizer, config, bf16=self.bf16)

        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0
        self.data_position = 0
        self.output_dir = config.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        self.history: list = []

    # ---------------------------------------------------------------- setup
    def _prepare_policy(self, model):
        config = self.config
        if config.lora_r > 0:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=config.lora_r,
                lora_alpha=config.lora_alpha,
                target_modules=list(config.lora_target_modules),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        return model.to(self.device).train()

    def _make_reference(self):
        """None when beta == 0; the policy itself for a peft policy (adapters off); else a frozen copy."""
        if self.config.beta == 0:
            return None
        if hasattr(self.policy, "disable_adapter"):  # peft: lora_r > 0 or a PeftModel passed in
            return self.policy
        reference = copy.deepcopy(self.policy).eval()
        reference.requires_grad_(False)
        return reference

    def _load_rows(self) -> list:
        config = self.config
        return load_rows(
            config.dataset,
            tokenizer=self.tokenizer,
            seed=config.seed,
            prompt_column=config.prompt_column,
            answer_column=config.answer_column,
            system_prompt=config.system_prompt,
        )

    def _resolve_rewards(self, reward_funcs):
        names = reward_funcs or self.config.reward_funcs
        if names is None:
            names = DEMO_REWARDS if self.config.dataset is None else DATASET_REWARDS
        funcs = [get_reward_function(name) for name in names]
        return funcs, [getattr(f, "__name__", str(f)) for f in funcs]

    def _lr_factor(self, optimizer_step: int) -> float:
        """Linear warmup over warmup_steps training steps, then constant, linear or cosine decay."""
        config = self.config
        mu = config.num_iterations
        warmup, total = config.warmup_steps * mu, config.steps * mu
        if optimizer_step < warmup:
            return (optimizer_step + 1) / (warmup + 1)
        progress = (optimizer_step - warmup) / max(1, total - warmup)
        if config.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if config.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    # ---------------------------------------------------------------- data
    def next_rows(self) -> tuple:
        """The next prompts_per_step rows and their data positions (the keys of their samples):
        a fresh seeded shuffle each epoch, so a position resumes."""
        rows, keys = [], []
        for _ in range(self.config.prompts_per_step):
            epoch, index = divmod(self.data_position, len(self.rows))
            rows.append(self.rows[self._epoch_order(epoch)[index]])
            keys.append(self.data_position)
            self.data_position += 1
        return rows, keys

    def _epoch_order(self, epoch: int) -> list:
        if getattr(self, "_order", (None,))[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.config.seed * 100_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    # ---------------------------------------------------------------- one step
    def make_rollout(self) -> Rollout:
        """The step's experience: samples, rewards, and the reference log-probs (beta != 0)."""
        batch = self.sample_groups()
        if self.reference is not None and batch.input_ids.shape[0]:
            with reference_context(self.policy, self.reference):
                ref = packed_completion_logprobs(
                    self.reference, self.micro_batches(batch), temperature=self.config.temperature, bf16=self.bf16
                )
            batch = dataclasses.replace(batch, ref_logprobs=ref)
        return batch

    def sample_groups(self) -> Rollout:
        """prompts_per_step groups of G samples with their rewards. With dynamic_sampling (DAPO)
        a group whose rewards are all equal is dropped (its advantages are 0: no signal) and
        another round of prompts is sampled, until the batch is full or max_sampling_rounds
        rounds ran; surplus groups of the last round are left out. The batch may then hold
        fewer groups, or none."""
        config = self.config
        G, wanted = config.group_size, config.prompts_per_step
        rounds_allowed = config.max_sampling_rounds if config.dynamic_sampling else 1
        parts, kept, dropped, rounds = [], 0, 0, 0
        while kept < wanted and rounds < rounds_allowed:
            rows, keys = self.next_rows()
            part = rollout(self.generator, rows, keys, self.reward_funcs, group_size=G)
            rounds += 1
            if config.dynamic_sampling:
                signal = groups_with_signal(part.rewards, G, config.reward_weights)
                dropped += int((~signal).sum())
                part = select_groups(part, signal.nonzero().squeeze(1)[: wanted - kept], G)
            kept += len(part.prompts) // G
            parts.append(part)
        batch = concat_rollouts(parts, self.tokenizer.pad_token_id)
        return dataclasses.replace(batch, sampling_rounds=rounds, dropped_groups=dropped)

    def micro_batches(self, batch: Rollout) -> list:
        """The batch's rows packed into micro-batches of at most max_tokens_per_micro_batch
        tokens (and micro_batch_size rows): :class:`~grpo_fast.trainer.packing.Packed` each."""
        config, C = self.config, batch.completion_mask.shape[1]
        lengths = batch.attention_mask.sum(1).tolist()
        slices = micro_batches(lengths, config.max_tokens_per_micro_batch, config.micro_batch_size)
        return [pack(batch.input_ids, batch.attention_mask, C, rows) for rows in slices]

    def compute_advantages(self, batch: Rollout) -> Rollout:
        """GRPO's critic-free advantages: each reward relative to its group's."""
        config = self.config
        advantages = group_advantages(
            batch.rewards, config.group_size, scale=config.advantage_scale, reward_weights=config.reward_weights
        )
        return dataclasses.replace(batch, advantages=GroupAdvantages(*(t.to(self.device) for t in advantages)))

    def _loss(self, batch: Rollout, packed: Packed, num_items: torch.Tensor, want_logprobs: bool = False):
        """``(loss output, log-probs [n, C] detached)`` of one packed micro-batch of ``batch``;
        the fused LM head returns no log-probs (None) unless ``want_logprobs`` (one more sweep).

        The loss is ``policy_loss`` on the rows' [n, C] completion grid (what ``grpo_loss``
        computes on padded logits); only the per-token log-probs travel to the grid, the
        logits [1, Nc, V] stay packed.
        """
        rows, config = packed.rows, self.loss_config
        present = batch.attention_mask[rows, -batch.completion_mask.shape[1] :].bool()  # [n, C] a token is there

        def on_grid(x):  # per-token inputs hold 0 where no token is (the loss weighs those 0)
            return None if x is None else x[rows].masked_fill(~present, 0.0)

        adv, mask = batch.advantages.advantages[rows], batch.completion_mask[rows]
        old, ref = on_grid(batch.old_logprobs), on_grid(batch.ref_logprobs)
        with autocast(self.device, self.bf16):
            if self.config.fused_linear:
                head = self.policy.get_output_embeddings()
                hidden = to_grid(packed_hidden(self.policy, packed), packed)  # [n, C, H]
                ids = to_grid(packed.targets, packed)
                out = fused_linear_grpo_loss(
                    hidden,
                    head.weight,
                    ids,
                    adv,
                    mask,
                    old,
                    ref,
                    bias=head.bias,
                    num_items_in_batch=num_items,
                    return_entropy=True,
                    loss_config=config,
                )
                if not want_logprobs:
                    return out, None
                logp = fused_linear_token_logprobs(
                    hidden.detach(), head.weight.detach(), ids, bias=head.bias, temperature=config.temperature
                )
                return out, logp
            logits = packed_logits(self.policy, packed)  # [1, Nc, V]
        logp, entropy = token_logprobs(logits, packed.targets, temperature=config.temperature, return_entropy=True)
        logp, entropy = to_grid(logp, packed), to_grid(entropy, packed)
        out = policy_loss(logp, adv, mask, old, ref, num_items_in_batch=num_items, entropy=entropy, loss_config=config)
        return out, logp.detach()

    def accumulate_gradients(self, batch: Rollout, num_items: torch.Tensor, logprobs: list | None = None) -> dict:
        """Backward over ``batch`` in packed micro-batches; the summed gradient is the full
        batch's: each micro-batch's loss is weighted by the loss type's aggregation (the loss spec).

        Args:
            num_items: the active-token count of the whole batch (dapo, cispo).
            logprobs: when a list, the policy's log-probs of each micro-batch ([n, C],
                detached) are appended to it, in row order.

        Returns the loss and the token-weighted means of the loss metrics over the batch.
        """
        N = batch.input_ids.shape[0]
        tokens = batch.completion_mask.sum(1)  # [N]
        total_tokens = tokens.sum().item()
        aggregation = self.loss_config.aggregation
        sums = dict.fromkeys(PASS_METRICS, 0.0)
        # Metrics are means over active tokens, but with sequence-level ratios the clip flags are
        # means over sequences: each micro-batch's value counts by its share of those.
        by_rows = {key for key in PASS_METRICS if key.startswith("clip")}
        by_rows = by_rows if self.loss_config.importance_sampling == "sequence" else set()
        for packed in self.micro_batches(batch):
            rows = packed.rows
            micro_tokens = tokens[rows].sum().item()
            token_share, row_share = micro_tokens / max(total_tokens, 1.0), (rows.stop - rows.start) / N
            weight = aggregation.micro_batch_weight(
                rows.stop - rows.start, micro_tokens, N, total_tokens, self.loss_config, num_items.item()
            )
            out, logp = self._loss(batch, packed, num_items, want_logprobs=logprobs is not None)
            (out.loss * weight).backward()
            if logprobs is not None:
                logprobs.append(logp)
            sums["loss"] += out.loss.item() * weight
            for key in PASS_METRICS[1:]:
                value, share = getattr(out, key), row_share if key in by_rows else token_share
                sums[key] = None if value is None or sums[key] is None else sums[key] + value.item() * share
        return sums

    def optimizer_step(self) -> dict:
        """Clips the gradient norm, steps the optimizer and the schedule, clears the gradients."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return dict(grad_norm=grad_norm)

    def train_step(self) -> dict:
        """One step: rollout -> advantages -> num_iterations x (backward passes -> optimizer).
        A step whose rollout kept no group (dynamic sampling) makes no update."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        batch = self.make_rollout()
        if batch.input_ids.shape[0] == 0:
            self.step += 1
            return self._step_metrics(batch, [], time.perf_counter() - start)
        batch = self.compute_advantages(batch)
        num_items = batch.completion_mask.sum()  # active tokens of the whole batch (dapo/cispo/bnpo)
        passes = []
        for _ in range(self.config.num_iterations):
            # The first pass runs at the sampling weights: its log-probs are the old policy's.
            record = [] if batch.old_logprobs is None and self.config.num_iterations > 1 else None
            sums = self.accumulate_gradients(batch, num_items, record)
            if record is not None:
                batch = dataclasses.replace(batch, old_logprobs=torch.cat(record))
            sums.update(self.optimizer_step())
            passes.append(sums)
        self.step += 1
        return self._step_metrics(batch, passes, time.perf_counter() - start, **self.extra_metrics(batch))

    def extra_metrics(self, batch: Rollout) -> dict:
        """More of the step's log line (the PPO baseline adds the critic's)."""
        return {}

    def _step_metrics(self, batch: Rollout, passes: list, elapsed: float, **extra) -> dict:
        """The step's log line: rollout statistics, the mean of each pass metric over the
        num_iterations passes (None when the step made no update), throughput and memory,
        ``extra`` and the per-reward means."""
        combined = batch.rewards.new_empty(0) if batch.advantages is None else batch.advantages.rewards
        scored = combined[~combined.isnan()]  # completions no reward function scored are left out, as TRL
        metrics = dict(
            step=self.step,
            reward_mean=scored.mean().item() if len(scored) else None,
            reward_std=scored.std().item() if len(scored) > 1 else None,
            frac_reward_zero_std=None if batch.advantages is None else batch.advantages.frac_zero_std.item(),
        )
        for key in passes[0] if passes else PASS_METRICS:
            values = [p[key] for p in passes]
            metrics[key] = None if None in values or not values else sum(values) / len(values)
        lengths = batch.completion_mask.sum(1)
        metrics.update(
            completion_len_mean=lengths.mean().item() if len(lengths) else None,
            tokens_per_s=batch.attention_mask.sum().item() / elapsed,
            step_time_s=elapsed,
            peak_mem_bytes=self._peak_memory(),
            learning_rate=self.scheduler.get_last_lr()[0],
            **extra,
        )
        if self.config.dynamic_sampling:
            metrics.update(sampling_rounds=batch.sampling_rounds, groups_dropped=batch.dropped_groups)
        for k, name in enumerate(self.reward_names):
            column = batch.rewards[:, k]
            metrics[f"rewards/{name}"] = column.nanmean().item() if not column.isnan().all() else None
        return metrics

    def _peak_memory(self) -> int:
        """Peak bytes: CUDA allocator peak of this step, or the process's peak resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # ---------------------------------------------------------------- checkpoints
    def trainable_state(self) -> dict:
        return {name: p.detach().cpu().clone() for name, p in self.policy.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> str:
        state = dict(
            step=self.step,
            data_position=self.data_position,
            model=self.trainable_state(),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            rng=ckpt.rng_state(),
            config=self.config.to_dict(),
        )
        return ckpt.save_checkpoint(self.output_dir, state, keep=self.config.keep_checkpoints)

    def resume(self, path: str | None = None) -> int:
        """Restores the newest checkpoint of the output dir (or ``path``); returns its step."""
        path = path or ckpt.latest_checkpoint(self.output_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(self.output_dir, 'checkpoints')!r}")
        state = ckpt.load_checkpoint(path)
        params = dict(self.policy.named_parameters())
        expected = {name for name, p in params.items() if p.requires_grad}
        if set(state["model"]) != expected:
            missing, extra = sorted(expected - set(state["model"])), sorted(set(state["model"]) - expected)
            raise ckpt.CheckpointError(
                f"checkpoint {path!r} does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        with torch.no_grad():
            for name, value in state["model"].items():
                if params[name].shape != value.shape:
                    raise ckpt.CheckpointError(
                        f"checkpoint {path!r}: {name} has shape {list(value.shape)}, "
                        f"the model {list(params[name].shape)}"
                    )
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.data_position = state["step"], state["data_position"]
        run_log.truncate_metrics(self.output_dir, self.step)
        self.history = run_log.read_metrics(self.output_dir)
        return self.step

    def save_model(self) -> str:
        """``save_pretrained`` of the policy and tokenizer to ``<output_dir>/final`` (via a temp dir)."""
        final = os.path.join(self.output_dir, "final")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.policy.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    # ---------------------------------------------------------------- the loop
    def train(self) -> list:
        """Runs the remaining steps; returns the metrics of every step of the run."""
        from tqdm.auto import tqdm

        config = self.config
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, "config.yaml"), "w") as f:
            import yaml

            yaml.safe_dump(config.to_dict(), f, sort_keys=False)
        start = time.perf_counter()
        bar = tqdm(total=config.steps, initial=self.step, disable=not config.progress, desc="grpo", unit="step")
        while self.step < config.steps:
            metrics = self.train_step()
            self.history.append(metrics)
            run_log.append_metrics(self.output_dir, metrics)
            reward, kl = metrics["reward_mean"], metrics["kl"]
            bar.set_postfix(
                reward="-" if reward is None else f"{reward:.3f}",
                kl="-" if kl is None else f"{kl:.4f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
                refresh=False,
            )
            bar.update(1)
            if (config.save_every and self.step % config.save_every == 0) or self.step == config.steps:
                self.save_checkpoint()
        bar.close()
        self.save_model()
        self.plot_path = run_log.plot_rewards(self.history, os.path.join(self.output_dir, "reward.png"))
        self.summary = run_log.summary(self.history, self.output_dir, time.perf_counter() - start)
        return self.history
