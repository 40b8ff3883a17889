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

Many devices (``distributed.py``; ``torchrun ... -m grpo_fast train``): each rank samples
and scores its contiguous share of every step's prompts, whole groups, from the one seeded
data order; the group advantages are computed from every rank's rewards (all-gathered), the
loss normalisers and micro-batch weights from global row and token counts, and every logged
statistic of the batch is reduced over ranks (timings are rank 0's), so a step's gradient and
its log line do not depend on the world size. Only rank 0 writes the metrics, plot, progress
bar and final model; every rank writes its shards of a checkpoint.
"""

import contextlib
import copy
import dataclasses
import math
import os
import random
import resource
import shutil
import time
import warnings

import torch
from transformers import get_scheduler, set_seed

from grpo_fast import group_advantages
from grpo_fast.ops.policy import LossInputs
from grpo_fast.outputs import GroupAdvantages
from grpo_fast.spec import SAMPLING_CORRECTIONS, sampling_correction
from grpo_fast.tasks import load_rows, resolve_rewards
from grpo_fast.trainer import checkpoint as ckpt
from grpo_fast.trainer import distributed, evaluation, run_log, trackers
from grpo_fast.trainer.async_rollout import AsyncRollouts
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.generators import make_generator
from grpo_fast.trainer.packed_policy import PackedPolicy, filler
from grpo_fast.trainer.packing import (
    Packed,
    flash_attention_available,
    pack_micro_batches,
    packed_attention,
    to_grid,
)
from grpo_fast.trainer.rollout import (
    Rollout,
    concat_rollouts,
    groups_with_signal,
    reference_context,
    rollout,
    sampling_metrics,
    select_groups,
)

# The loss and the loss metrics that each backward pass logs (LossOutput's fields but ratio_mean).
PASS_METRICS = ("loss", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy")


# transformers' schedule behind each of the config's lr_schedule names (get_scheduler is imported
# with this module, not lazily inside a measured window such as bench/memory.py's)
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_scheduler(optimizer, config: GRPOConfig):
    """The run's learning-rate schedule, one step per optimizer step (num_iterations per
    training step): linear warmup over warmup_steps training steps, then constant, or linear or
    cosine decay towards 0 at the run's last step (transformers' ``get_scheduler``).

    transformers' warmup runs its first step at learning rate 0; ours runs optimizer step s at
    ``(s + 1) / (warmup + 1)`` of it, so the schedule is built one step longer and advanced
    once here: optimizer step s runs at transformers' step s + 1. A checkpoint stores the
    state at the optimizer-step count (:func:`schedule_state`).
    """
    mu = config.num_iterations
    scheduler = get_scheduler(
        SCHEDULES[config.lr_schedule],
        optimizer,
        num_warmup_steps=config.warmup_steps * mu + 1,
        num_training_steps=config.steps * mu + 1,
    )
    with warnings.catch_warnings():  # the advance above, not a step taken before the optimizer's
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()
    return scheduler


def schedule_state(scheduler) -> dict:
    """The scheduler's state with ``last_epoch`` the optimizer steps taken (see :func:`lr_scheduler`)."""
    state = scheduler.state_dict()
    return dict(state, last_epoch=state["last_epoch"] - 1)


def load_schedule_state(scheduler, state: dict) -> None:
    scheduler.load_state_dict(dict(state, last_epoch=state["last_epoch"] + 1))


def load_model_and_tokenizer(config: GRPOConfig, flash_attention: bool = False):
    """The policy and tokenizer: from ``config.model`` (a local path) or the built-in demo.
    ``flash_attention`` loads the model with ``flash_attention_2``, whose varlen kernels run
    the packed forwards (see ``packing.py``)."""
    if config.model is None:
        from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        # vLLM's CPU attention needs heads of 32 or more: its demo model has 2 heads of 32 (the
        # same weight shapes as the default's 4 heads of 16)
        heads = dict(num_attention_heads=2, num_key_value_heads=2) if config.generator == "vllm" else {}
        return build_model(tokenizer, seed=config.seed, **heads), tokenizer
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
    Hugging Face engine draws from torch's). A ``model`` passed in is trained in place, not
    copied: it is moved to the device and put in train mode, wrapped by peft with LoRA
    adapters (lora_r > 0) and, with gradient checkpointing, gets ``config.use_cache = False``.
    The caller's tokenizer, thread counts and plotting backend are left as they were. Under torchrun it
    joins the job's process group (``distributed.setup``) and wraps the policy in DDP or
    FSDP2 (``config.parallel``).

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
        set_seed(config.seed)
        self.device = distributed.resolve_device(config.device)
        self.ranks = distributed.setup(self.device, config.collective_timeout_s)
        if config.prompts_per_step % self.ranks.world_size:
            raise ValueError(
                f"batch_size={config.batch_size} gives {config.prompts_per_step} prompts per step (batch_size / "
                f"group_size), which must be divisible by the world size {self.ranks.world_size}: each rank samples "
                "the same number of whole groups"
            )
        if config.compile_generation and config.parallel == "fsdp" and self.ranks.active:
            raise ValueError(
                "compile_generation replays a CUDA graph on fixed weight addresses, but under FSDP2 the weights are "
                "gathered anew for each rollout: use parallel='ddp', or no compile_generation"
            )
        self.bf16 = config.bf16(self.device)
        if model is None:
            model, tokenizer = load_model_and_tokenizer(config, flash_attention_available(self.device, self.bf16))
        elif tokenizer is None:
            raise ValueError("a model passed to GRPOTrainer needs its tokenizer")
        self.tokenizer = tokenizer
        self.policy = self._prepare_policy(model)
        self.reference = self._make_reference()
        self._wrap()
        self.rows = rows if rows is not None else self._load_rows()
        self.reward_funcs, self.reward_names = self._resolve_rewards(reward_funcs)
        self.generator = make_generator(config.generator, self.policy, tokenizer, config, bf16=self.bf16)
        self.evaluator = None
        if config.eval_every or config.eval_dataset is not None:
            eval_rows = evaluation.load_eval_rows(config, tokenizer)
            self.evaluator = evaluation.Evaluator(
                self.policy, tokenizer, config, eval_rows, self.reward_funcs, self.reward_names, self.ranks, self.bf16
            )
        # max_staleness >= 1: a worker process samples ahead (started on the first batch, see close())
        self.async_rollouts = AsyncRollouts(self) if config.max_staleness else None

        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        self.scheduler = lr_scheduler(self.optimizer, config)
        self.step = 0
        self.data_position = 0
        self.output_dir = self.ranks.broadcast(
            config.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        )
        self.history: list = []
        if self.ranks.rank:  # the model is built alike everywhere; the Hugging Face engine must not draw alike
            set_seed(config.seed + self.ranks.rank)

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
            with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                model = get_peft_model(model, lora)
        if config.gradient_checkpointing:
            # activation_checkpointing_enable is gradient_checkpointing_enable's name from transformers 5.2x
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
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

    def _wrap(self):
        """The modules every packed pass runs: ``packed_policy`` (the policy's, sharded in place
        under FSDP2), ``train_module`` (what the backward passes run: DDP's wrapper of it, or it)
        and ``reference_module`` (the frozen copy's, sharded alike; the policy's own for a peft
        policy, whose reference is itself with adapters off)."""
        config = self.config
        self.filler = filler(self.device)
        self.packed_policy = PackedPolicy(self.policy, self.loss_config, bf16=self.bf16, entropy=config.log_entropy)
        self.train_module = distributed.wrap(self.packed_policy, config.parallel, self.device, bf16=self.bf16)
        self.reference_module = None
        if self.reference is self.policy:
            self.reference_module = self.packed_policy
        elif self.reference is not None:
            self.reference_module = distributed.wrap(
                PackedPolicy(self.reference, self.loss_config, bf16=self.bf16),
                config.parallel,
                self.device,
                bf16=self.bf16,
                trainable=False,
            )
        for module in dict.fromkeys(m for m in (self.packed_policy, self.reference_module) if m is not None):
            if distributed.is_sharded(module):
                # FSDP2 finds its root on the first forward: the root's, before any layer runs alone
                # (generation calls the layers). The root keeps its whole weights after a forward;
                # the optimizer needs the shards.
                with torch.no_grad():
                    module(self.filler)
                module.reshard()

    def _load_rows(self) -> list:
        config = self.config
        return load_rows(
            config.dataset,
            tokenizer=self.tokenizer,
            seed=config.seed,
            hold_out=evaluation.demo_holds_out(config),
            prompt_column=config.prompt_column,
            answer_column=config.answer_column,
            system_prompt=config.system_prompt,
        )

    def _resolve_rewards(self, reward_funcs):
        return resolve_rewards(reward_funcs or self.config.reward_funcs, self.config.dataset)

    # ---------------------------------------------------------------- data
    def next_rows(self) -> tuple:
        """This rank's share of the next prompts_per_step rows, and their data positions (the
        keys of their samples): a fresh seeded shuffle each epoch, so a position resumes. Every
        rank walks the same order and takes its contiguous share."""
        rows, keys = [], []
        for _ in range(self.config.prompts_per_step):
            epoch, index = divmod(self.data_position, len(self.rows))
            rows.append(self.rows[self._epoch_order(epoch)[index]])
            keys.append(self.data_position)
            self.data_position += 1
        mine = self.ranks.share(len(rows))
        return rows[mine], keys[mine]

    def _epoch_order(self, epoch: int) -> list:
        if getattr(self, "_order", (None,))[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.config.seed * 100_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    # ---------------------------------------------------------------- one step
    def make_rollout(self) -> Rollout:
        """The step's experience: samples (the rollout worker's batch when max_staleness >= 1),
        rewards, and the reference log-probs (beta != 0). The sampling correction, where the
        samples' log-probs are not the trainer's (the vllm engine, a worker's possibly stale
        batch), is left to the step's first training pass (:meth:`corrects`)."""
        batch = self.pack_batch(self.async_rollouts.next() if self.async_rollouts else self.sample_groups())
        if self.reference is not None and self.ranks.sum(batch.input_ids.shape[0]):
            done = batch.ref_logprobs  # a rollout worker's batch: its first micro-batches' rows, or None
            first = 0 if done is None else done.shape[0]
            with reference_context(self.policy, self.reference):
                rest = self.packed_logprobs(self.reference_module, batch, first)
            batch = dataclasses.replace(batch, ref_logprobs=rest if done is None else torch.cat([done, rest]))
        return batch

    def corrects(self, batch: Rollout) -> bool:
        """Whether ``batch`` needs the loss spec's ``sampling_correction`` (TRL's) and has not
        had it yet. Its weights compare the trainer's log-probs at the weights the step starts
        with (the proximal policy) with the sampler's: those are the first training pass's
        own log-probs, so that pass computes the weights micro-batch by micro-batch
        (``PackedPolicy``'s ``correct``) and no extra forward runs, where TRL runs one; the
        step then keeps them, with the proximal log-probs as the old ones, for its later
        passes (:meth:`after_first_pass`)."""
        return (
            batch.sampling_logprobs is not None
            and self.config.correction_mode() is not None
            and batch.importance_weights is None
        )

    def sampling_correction(self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor):
        """The run's ``spec.sampling_correction`` of log-probs [n, C]."""
        config = self.config
        return sampling_correction(
            proximal,
            behaviour,
            mask,
            mode=config.correction_mode(),
            clip_min=config.sampling_correction_min,
            clip_max=config.sampling_correction_max,
        )

    def after_first_pass(self, batch: Rollout, proximal: torch.Tensor) -> Rollout:
        """The batch as the step's later passes use it, given the first pass's log-probs [N, C]
        (the proximal policy's): those as the old log-probs when num_iterations > 1, and the
        sampling correction's weights and TRL's ``sampling/*`` metrics (device tensors, read
        with the step's) over every rank's tokens."""
        changes = dict(old_logprobs=proximal) if self.config.num_iterations > 1 else {}
        if self.corrects(batch):
            mask = batch.completion_mask
            correction = self.sampling_correction(proximal, batch.sampling_logprobs, mask)
            sequence_level = SAMPLING_CORRECTIONS[self.config.correction_mode()][0] == "sequence"
            metrics = sampling_metrics(
                proximal, batch.sampling_logprobs, mask, correction.ratio, sequence_level, self.ranks
            )
            changes.update(importance_weights=correction.weights, sampling_metrics=metrics)
        return dataclasses.replace(batch, **changes)

    @torch.no_grad()
    def packed_logprobs(self, module: PackedPolicy, batch: Rollout, first_row: int = 0) -> torch.Tensor:
        """The completion tokens' log-probs [N - first_row, C] under ``module``, from the
        batch's packed micro-batches from row ``first_row`` on (a micro-batch's first row; run
        in lockstep with the other ranks: under FSDP2 a forward is a collective)."""
        out = []
        micro = [packed for packed in self.micro_batches(batch) if packed.rows.start >= first_row]
        for packed, _ in self.ranks.lockstep(micro):
            logp = module(self.filler if packed is None else packed)
            if packed is not None:
                out.append(logp)
        if distributed.is_sharded(module):
            module.reshard()  # no backward follows to reshard the root: free its whole weights now
        return torch.cat(out) if out else torch.zeros_like(batch.completion_mask[first_row:])

    def sample_groups(self) -> Rollout:
        """This rank's share of prompts_per_step groups of G samples with their rewards (the
        weights gathered for generation under FSDP2). With dynamic_sampling (DAPO)
        a group whose rewards are all equal is dropped (its advantages are 0: no signal) and
        another round of prompts is sampled, until the batch is full or max_sampling_rounds
        rounds ran; surplus groups of the last round are left out. The batch may then hold
        fewer groups, or none."""
        config = self.config
        G, wanted = config.group_size, config.prompts_per_step
        rounds_allowed = config.max_sampling_rounds if config.dynamic_sampling else 1
        parts, kept, dropped, rounds = [], 0, 0, 0  # kept, dropped: groups over every rank
        while kept < wanted and rounds < rounds_allowed:
            rows, keys = self.next_rows()
            # An engine with its own copy of the weights (vllm) needs no gathered policy under FSDP2.
            gather = getattr(self.generator, "runs_policy", True)
            with distributed.gathered(self.packed_policy) if gather else contextlib.nullcontext():
                part = rollout(self.generator, rows, keys, self.reward_funcs, group_size=G)
            rounds += 1
            if config.dynamic_sampling:
                # Every rank's groups of the round in data order, so that all ranks keep the same
                # first groups with a signal that a single process would.
                signal, first = self.ranks.gather_rows(groups_with_signal(part.rewards, G, config.reward_weights))
                dropped += int((~signal).sum())
                chosen = signal.nonzero().squeeze(1)[: wanted - kept]
                kept += len(chosen)
                part = select_groups(part, chosen[(chosen >= first) & (chosen < first + len(rows))] - first, G)
            else:
                kept = wanted
            parts.append(part)
        batch = concat_rollouts(parts, self.tokenizer.pad_token_id)
        return dataclasses.replace(batch, sampling_rounds=rounds, dropped_groups=dropped)

    def micro_batches(self, batch: Rollout) -> list:
        """The batch's rows packed into micro-batches of at most max_tokens_per_micro_batch
        tokens (and micro_batch_size rows): :class:`~grpo_fast.trainer.packing.Packed` each.
        Those of ``batch.packed`` (``pack_batch``) when they were packed from these very
        token tensors under the same limits; else packed now, with one read of the rows'
        lengths to the host."""
        config, C = self.config, batch.completion_mask.shape[1]
        key = (config.max_tokens_per_micro_batch, config.micro_batch_size, batch.input_ids, batch.attention_mask)
        if batch.packed is not None:
            (*limits, ids, mask), packed = batch.packed
            if limits == list(key[:2]) and ids is batch.input_ids and mask is batch.attention_mask:
                return packed
        return pack_micro_batches(batch.input_ids, batch.attention_mask, C, *key[:2])

    def pack_batch(self, batch: Rollout) -> Rollout:
        """``batch`` with its micro-batches packed once, for every pass of the step."""
        config = self.config
        key = (config.max_tokens_per_micro_batch, config.micro_batch_size, batch.input_ids, batch.attention_mask)
        return dataclasses.replace(batch, packed=(key, self.micro_batches(batch)))

    def compute_advantages(self, batch: Rollout) -> Rollout:
        """GRPO's critic-free advantages: each reward relative to its group's. They are computed
        from every rank's rewards [N_global, K] (a few numbers a row; a group never spans ranks,
        but scale="batch" and the logged statistics are the global batch's); this rank keeps its rows."""
        config, G, N = self.config, self.config.group_size, batch.rewards.shape[0]
        # [N_global, 1 + K]: the completion lengths travel with the rewards, for the step's log line
        table, first = self.ranks.gather_rows(torch.cat([self._lengths(batch)[:, None], batch.rewards], 1))
        stats = group_advantages(table[:, 1:], G, scale=config.advantage_scale, reward_weights=config.reward_weights)
        rows, groups = slice(first, first + N), slice(first // G, (first + N) // G)
        mine = GroupAdvantages(
            stats.advantages[rows], stats.rewards[rows], stats.mean[groups], stats.std[groups], stats.frac_zero_std
        )
        return dataclasses.replace(
            batch,
            advantages=GroupAdvantages(*(t.to(self.device) for t in mine)),
            scores=torch.cat([stats.rewards[:, None], table], 1),
        )

    @staticmethod
    def _lengths(batch: Rollout) -> torch.Tensor:
        """The completion lengths [N] in the rewards' dtype and device."""
        return batch.completion_mask.sum(1).to(batch.rewards)

    def _loss(self, batch: Rollout, packed: Packed, num_items: torch.Tensor):
        """``(loss output, log-probs [Nc] detached)`` of one packed micro-batch of ``batch``
        (``PackedPolicy.forward`` through ``train_module``). The per-token inputs are gathered
        from the rollout's [N, C] grid to the packed tokens' flat rows [Nc]."""
        rows, (row, col) = packed.rows, packed.grid

        def tokens(x):  # [n, C] -> [Nc]
            return None if x is None else x[rows][row, col]

        advantages = batch.advantages.advantages[rows]  # [n] per sequence, or [n, C] (PPO)
        correct = None
        if self.corrects(batch):
            behaviour, mask = batch.sampling_logprobs[rows], batch.completion_mask[rows]

            def correct(logp):  # the micro-batch's log-probs [Nc] -> its importance weights [Nc]
                return self.sampling_correction(to_grid(logp.unsqueeze(0), packed), behaviour, mask).weights[row, col]

        inputs = LossInputs(
            advantages.unsqueeze(1) if advantages.dim() == 1 else tokens(batch.advantages.advantages),
            tokens(batch.completion_mask),
            tokens(batch.old_logprobs),
            tokens(batch.ref_logprobs),
            tokens(batch.importance_weights),
            num_items_in_batch=num_items,
            cu_seqlens=packed.completion_cu_seqlens,
        )
        return self.train_module(packed, inputs, fused_linear=self.config.fused_linear, correct=correct)

    def accumulate_gradients(
        self, batch: Rollout, num_items: torch.Tensor, logprobs: list | None = None, *, read: bool = True
    ) -> dict:
        """Backward over ``batch`` in packed micro-batches; the summed gradient is the full
        batch's: each micro-batch's loss is weighted by the loss type's aggregation (the loss
        spec) over the global batch's row and token counts, times the world size, since DDP and
        FSDP2 average gradients over ranks. A rank with fewer micro-batches than another runs
        fillers (loss times 0) so that the ranks' collectives match. Nothing is read to the
        host: the metrics accumulate on the device.

        Args:
            num_items: the active-token count of the whole batch, every rank's (a tensor).
            logprobs: when a list, the policy's log-probs of each micro-batch ([n, C],
                detached) are appended to it, in row order.
            read: return the metrics as numbers (one host read, :meth:`read_metrics`); False
                leaves them on the device, this rank's, for the step to read once.

        Returns the loss and the token-weighted means of the loss metrics over the global batch.
        """
        ranks = self.ranks
        # Counts in float64, as Python's numbers were: the weights must not round the gradient.
        tokens = batch.completion_mask.sum(1, dtype=torch.float64)  # [N]
        total_rows = ranks.sum(tokens.new_tensor(float(batch.input_ids.shape[0])))
        total_tokens = num_items = torch.as_tensor(num_items, dtype=torch.float64, device=tokens.device)
        aggregation = self.loss_config.aggregation
        sums = dict.fromkeys(PASS_METRICS, 0.0)
        # Metrics are means over active tokens, but with sequence-level ratios the clip flags are
        # means over sequences: each micro-batch's value counts by its share of those.
        by_rows = {key for key in PASS_METRICS if key.startswith("clip")}
        by_rows = by_rows if self.loss_config.importance_sampling == "sequence" else set()
        for packed, sync in ranks.lockstep(self.micro_batches(batch)):
            # The packed attention holds through the backward: gradient checkpointing recomputes
            # each layer's forward there, and must attend as the forward did.
            with distributed.gradient_sync(self.train_module, sync), packed_attention(self.policy):
                if packed is None:
                    (self.train_module(self.filler).sum() * 0.0).backward()
                    continue
                rows = packed.rows
                micro_tokens = tokens[rows].sum()
                token_share = micro_tokens / total_tokens.clamp(min=1.0)
                row_share = (rows.stop - rows.start) / total_rows
                weight = aggregation.micro_batch_weight(
                    rows.stop - rows.start, micro_tokens, total_rows, total_tokens, self.loss_config, num_items
                )
                out, logp = self._loss(batch, packed, num_items)
                (out.loss * (weight * ranks.world_size)).backward()
            if logprobs is not None:
                logprobs.append(to_grid(logp.unsqueeze(0), packed))
            sums["loss"] = sums["loss"] + out.loss.detach() * weight
            for key in PASS_METRICS[1:]:
                value, share = getattr(out, key), row_share if key in by_rows else token_share
                sums[key] = None if value is None or sums[key] is None else sums[key] + value * share
        return self.read_metrics([sums])[0] if read else sums

    def read_metrics(self, passes: list) -> list:
        """The passes' metrics (dicts of 0-dim device tensors, numbers or None) as numbers, in
        one host read: the loss metrics (``PASS_METRICS``) summed over ranks, the others (the
        gradient norms) as they are; a loss metric is None when it is None on any rank."""
        keys = [(i, key) for i, metrics in enumerate(passes) for key in metrics]
        if not keys:
            return [{} for _ in passes]

        def entry(value):  # [value, is None], float64 on the device
            if not torch.is_tensor(value):
                values = [0.0 if value is None else float(value), float(value is None)]
                return torch.tensor(values, dtype=torch.float64, device=self.device)
            value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2's gradient norm
            return torch.nn.functional.pad(value.detach().to(self.device, torch.float64).reshape(1), (0, 1))

        table = torch.stack([entry(passes[i][key]) for i, key in keys])  # [entries, 2]
        if self.ranks.world_size > 1:
            summed = torch.tensor([key in PASS_METRICS for _, key in keys], device=self.device)
            table = torch.where(summed[:, None], self.ranks.sum(table), table)
        out = [{} for _ in passes]
        for (i, key), (value, none) in zip(keys, table.tolist()):
            out[i][key] = None if none else value
        return out

    def optimizer_step(self) -> dict:
        """Clips the gradient norm, steps the optimizer and the schedule, clears the gradients.
        Returns the gradient norm as a device tensor (read with the step's metrics)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.async_rollouts:
            self.async_rollouts.publish()
        return dict(grad_norm=grad_norm)

    def train_step(self) -> dict:
        """One step: rollout -> advantages -> num_iterations x (backward passes -> optimizer).
        A step whose rollout kept no group on any rank (dynamic sampling) makes no update. The
        training passes read nothing to the host; the step's metrics are read once, at its end."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        batch = self.make_rollout()
        if self.ranks.sum(batch.input_ids.shape[0]) == 0:
            self.step += 1
            return self._step_metrics(batch, [], start)
        batch = self.compute_advantages(batch)
        num_items = self.ranks.sum(batch.completion_mask.sum())  # active tokens of the whole batch (dapo/cispo/bnpo)
        passes = []
        for _ in range(self.config.num_iterations):
            # The first pass runs at the weights the step starts with: its log-probs are the
            # old (proximal) policy's, which the later passes and the sampling correction read.
            first = batch.old_logprobs is None and (self.config.num_iterations > 1 or self.corrects(batch))
            record = [] if first else None
            sums = self.accumulate_gradients(batch, num_items, record, read=False)
            if record is not None:
                batch = self.after_first_pass(
                    batch, torch.cat(record) if record else torch.zeros_like(batch.completion_mask)
                )
            sums.update(self.optimizer_step())
            passes.append(sums)
        self.step += 1
        return self._step_metrics(batch, passes, start, **self.extra_metrics(batch))

    def extra_metrics(self, batch: Rollout) -> dict:
        """More of the step's log line (the PPO baseline adds the critic's; asynchronous
        rollouts add the batch's staleness, the waits and the weight copies)."""
        return dict(self.async_rollouts.metrics) if self.async_rollouts else {}

    def _step_metrics(self, batch: Rollout, passes: list, start: float, **extra) -> dict:
        """The step's log line, over every rank's rows: rollout statistics, the mean of each
        pass metric over the num_iterations passes (None when the step made no update),
        throughput and memory (the largest rank's peak), ``extra`` and the per-reward means.
        Everything the device holds is read to the host at once; the step's time ends there."""
        ranks = self.ranks
        self.last_rollout = batch  # the completions log samples it
        table = batch.scores  # [N_global, 2 + K]: the combined reward, the completion length, each reward
        if table is None:  # no advantages were computed: gather the rewards here
            gathered, _ = ranks.gather_rows(torch.cat([self._lengths(batch)[:, None], batch.rewards], 1))
            table = torch.cat([torch.full_like(gathered[:, :1], math.nan), gathered], 1)
        combined, lengths, rewards = table[:, 0], table[:, 1], table[:, 2:]
        scored = ~combined.isnan()  # completions no reward function scored are left out, as TRL
        count = scored.sum()
        mean = combined.nan_to_num().sum() / count
        variance = ((combined - mean).nan_to_num() ** 2).sum() / (count - 1)
        stats = dict(
            scored=count,
            reward_mean=mean,
            reward_std=variance.sqrt(),
            frac_reward_zero_std=None if batch.advantages is None else batch.advantages.frac_zero_std,
            completion_len_mean=lengths.mean(),
            tokens=ranks.sum(batch.attention_mask.sum()),
            **{f"rewards/{name}": rewards[:, k].nanmean() for k, name in enumerate(self.reward_names)},
            **batch.sampling_metrics,
        )
        *passes, stats = self.read_metrics([*passes, stats])
        elapsed = time.perf_counter() - start
        metrics = dict(
            step=self.step,
            reward_mean=stats["reward_mean"] if stats["scored"] else None,
            reward_std=stats["reward_std"] if stats["scored"] > 1 else None,
            frac_reward_zero_std=stats["frac_reward_zero_std"],
        )
        for key in passes[0] if passes else PASS_METRICS:
            values = [p[key] for p in passes]
            metrics[key] = None if None in values or not values else sum(values) / len(values)
        metrics.update(
            completion_len_mean=stats["completion_len_mean"] if len(lengths) else None,
            tokens_per_s=stats["tokens"] / elapsed,
            step_time_s=elapsed,
            peak_mem_bytes=ranks.max(self._peak_memory()),
            learning_rate=self.scheduler.get_last_lr()[0],
            **extra,
            **{key: stats[key] for key in batch.sampling_metrics},
            **getattr(self.generator, "metrics", dict)(),
        )
        if self.config.dynamic_sampling:
            metrics.update(sampling_rounds=batch.sampling_rounds, groups_dropped=batch.dropped_groups)
        for name in self.reward_names:
            value = stats[f"rewards/{name}"]
            metrics[f"rewards/{name}"] = None if math.isnan(value) else value
        return metrics

    def _peak_memory(self) -> int:
        """Peak bytes: CUDA allocator peak of this step, or the process's peak resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # ---------------------------------------------------------------- checkpoints
    def trained_parts(self) -> dict:
        """The trained modules beside the policy, ``{name: (model, optimizer, scheduler)}``,
        that a checkpoint holds under their names (the PPO baseline's critic)."""
        return {}

    def save_checkpoint(self) -> str:
        """Writes the step's checkpoint (every rank its shards; ``checkpoint.py``)."""
        parts = self.trained_parts()
        state = dict(
            step=self.step,
            data_position=self.data_position,
            scheduler=schedule_state(self.scheduler),
            config=self.config.to_dict(),
            **{f"{name}_scheduler": schedule_state(scheduler) for name, (_, _, scheduler) in parts.items()},
        )
        more = {name: part[:2] for name, part in parts.items()}
        return ckpt.save_checkpoint(
            self.output_dir,
            state,
            self.policy,
            self.optimizer,
            self.ranks,
            keep=self.config.keep_checkpoints,
            more=more,
        )

    def resume(self, path: str | None = None) -> int:
        """Restores the newest checkpoint of the output dir (or ``path``), written at any world
        size; returns its step."""
        path = self.ranks.broadcast(path or ckpt.latest_checkpoint(self.output_dir))
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(self.output_dir, 'checkpoints')!r}")
        parts = self.trained_parts()
        state = ckpt.load_checkpoint(
            path, self.policy, self.optimizer, self.ranks, more={name: part[:2] for name, part in parts.items()}
        )
        load_schedule_state(self.scheduler, state["scheduler"])
        for name, (_, _, scheduler) in parts.items():
            load_schedule_state(scheduler, state[f"{name}_scheduler"])
        self.step, self.data_position = state["step"], state["data_position"]
        if self.ranks.is_main:
            run_log.truncate_metrics(self.output_dir, self.step)
        self.ranks.barrier()
        self.history = run_log.read_metrics(self.output_dir)
        return self.step

    def save_model(self) -> str:
        """``save_pretrained`` of the policy and tokenizer to ``<output_dir>/final`` (via a temp
        dir), by rank 0; under FSDP2 the whole weights are first gathered to its CPU."""
        final = os.path.join(self.output_dir, "final")
        weights = ckpt.full_model_state(self.policy) if distributed.is_sharded(self.packed_policy) else None
        if self.ranks.is_main:
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.policy.save_pretrained(tmp, state_dict=weights)
            self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        self.ranks.barrier()
        return final

    # ---------------------------------------------------------------- the loop
    def evaluate(self) -> dict:
        """The eval metrics of the policy now (``evaluation.py``; every rank its share)."""
        with distributed.gathered(self.packed_policy):
            return self.evaluator()

    def train(self) -> list:
        """Runs the remaining steps; returns the metrics of every step of the run. Rank 0
        writes the config, metrics, completions, progress bar and plot, and reports to the
        trackers; every eval_every steps the metrics line gains the eval metrics."""
        from tqdm.auto import tqdm

        config, main = self.config, self.ranks.is_main
        tracker = trackers.Tracker()
        if main:
            import yaml

            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config.to_dict(), f, sort_keys=False)
            tracker = trackers.open_trackers(config.report_to, self.output_dir, config.to_dict())
        start = time.perf_counter()
        bar = tqdm(
            total=config.steps, initial=self.step, disable=not (config.progress and main), desc="grpo", unit="step"
        )
        try:
            while self.step < config.steps:
                metrics = self.train_step()
                if self.evaluator is not None and (
                    self.step == config.steps or run_log.due(self.step, config.eval_every, config.steps)
                ):
                    metrics.update(self.evaluate())
                self.history.append(metrics)
                if main:
                    run_log.append_metrics(self.output_dir, metrics)
                    tracker.log(metrics, self.step)
                    batch = self.last_rollout
                    if (
                        run_log.due(self.step, config.log_completions_every, config.steps)
                        and batch.advantages is not None
                    ):
                        rows = run_log.completion_rows(batch, self.step, self.reward_names)
                        run_log.append_completions(self.output_dir, rows)
                        tracker.log_table("completions", rows, self.step)
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
        finally:
            self.close()
        bar.close()
        tracker.close()
        self.save_model()
        self.plot_path = (
            run_log.plot_rewards(self.history, os.path.join(self.output_dir, "reward.png")) if main else None
        )
        self.summary = run_log.summary(self.history, self.output_dir, time.perf_counter() - start)
        return self.history

    def close(self) -> None:
        """Stops the rollout worker, if one runs (``train()`` does on its way out, error or not;
        a caller of ``train_step()`` does when done). A checkpoint resumes after the trained
        steps: the batches in flight are sampled again."""
        if self.async_rollouts:
            self.async_rollouts.close()
