"""GRPOTrainer: the lean GRPO loop, its step told in stages (``run_step``), each in its side's folder:

    samples  <- the rollout source: G samples per prompt with rewards [N, K]     rollout/
    batch    <- prepare: group advantages, reference log-probs, micro-batches    update/batch.py
    for each of num_iterations passes:
        backward over the micro-batches (the first one's log-probs: proximal)    update/passes.py
        clip, AdamW step, LR schedule; publish the weights to the source         update/optimization.py
    log line: one host read                                                      update/metrics.py

The run around it (trackers, evaluation, completions, checkpoints, plot) is ``run/``; the models
it trains are built by ``model/build.py``. Where the loss's advantages come from, and what trains
beside the policy, is the run's :class:`~grpo_fast.trainer.update.strategy.Strategy` (GRPO's by
default: group advantages, the policy alone), which the step calls at its stages.

Choices: the loss's options are one :class:`grpo_fast.LossConfig` built once from the config;
its temperature is the sampling temperature (the log-probs are those of the distribution that
sampled). The forwards run at the precision the run's :class:`~grpo_fast.trainer.runtime.Runtime`
decided (bf16 on CUDA by default) while weights and optimizer state stay float32.

Many devices (``distributed.py``; ``torchrun ... -m grpo_fast train``): each rank samples and
scores its contiguous share of every step's prompts, whole groups, from the one seeded data
order; advantages, loss normalisers, micro-batch weights and every logged statistic come from
every rank's rows, so a step's gradient and its log line do not depend on the world size. Only
rank 0 writes the metrics, plot, progress bar and final model; every rank its checkpoint shards.
"""

import os
import time
from typing import NamedTuple

import torch

from grpo_fast.environments import load_environment
from grpo_fast.tasks import load_rows, resolve_rewards
from grpo_fast.tools import resolve_tools
from grpo_fast.trainer import distributed
from grpo_fast.trainer.checks import check_model_source
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.model.build import (
    load_model_and_tokenizer,
    make_reference,
    prepare_policy,
    wrap_modules,
)
from grpo_fast.trainer.rollout.data import DataOrder
from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
from grpo_fast.trainer.rollout.samples import Samples
from grpo_fast.trainer.rollout.sources import InProcessRollouts
from grpo_fast.trainer.rollout.turns import turn_loop
from grpo_fast.trainer.rollout.worker import AsyncRollouts
from grpo_fast.trainer.run import checkpoint, evaluation, hub, loop, run_log
from grpo_fast.trainer.runtime import Runtime, set_seed
from grpo_fast.trainer.update.batch import StepBatch, batch_fields
from grpo_fast.trainer.update.metrics import PhaseClock, log_line
from grpo_fast.trainer.update.optimization import adamw, clipped_step, lr_scheduler
from grpo_fast.trainer.update.passes import PassResult, Proximal, accumulate, corrects
from grpo_fast.trainer.update.strategy import Strategy


class StepResult(NamedTuple):
    """A training step's log line and the batch it trained on."""

    metrics: dict
    batch: StepBatch


class GRPOTrainer:
    """Trains ``model`` (or the one ``config`` names) with GRPO on ``rows`` (or ``config.dataset``).

    The trainer seeds the global random generators with ``config.seed`` (sampling with the
    Hugging Face engine draws from torch's). A ``model`` passed in is trained in place, not
    copied: it is moved to the device and put in train mode, wrapped by peft with LoRA
    adapters (lora_r > 0) and, with gradient checkpointing, gets ``config.use_cache = False``.
    The caller's tokenizer, thread counts and plotting backend are left as they were. Under
    torchrun it joins the job's process group (``distributed.setup``) and wraps the policy in DDP
    or FSDP2 (``config.parallel``).

    Args:
        config: the run (see :class:`GRPOConfig`).
        model, tokenizer: an already loaded policy and tokenizer (default: from ``config``).
        rows: prompt rows ``{"prompt": str, ...}`` (default: from ``config``).
        reward_funcs: callables or names (default: ``config.reward_funcs``, else the task's).
        tools: callables or names the model may call (default: ``config.tools``).
        environment: the episodes' environment: a class (ours, or TRL's ``environment_factory``)
            or a name (default: ``config.environment``).
        strategy: where the advantages come from and what trains beside the policy (default:
            GRPO's, :class:`~grpo_fast.trainer.update.strategy.Strategy`).
    """

    def __init__(
        self,
        config: GRPOConfig,
        *,
        model=None,
        tokenizer=None,
        rows=None,
        reward_funcs=None,
        tools=None,
        environment=None,
        strategy: Strategy | None = None,
    ):
        config.validate()
        config.check_tools(tools)
        self.strategy = Strategy() if strategy is None else strategy
        if not isinstance(self.strategy, Strategy):
            raise TypeError(f"strategy must be a Strategy, got {type(strategy).__name__}")
        self.strategy.check(config, tools)
        # tools and the environment refused before anything loads, the chat template before the model
        self.tools = resolve_tools(tools if tools is not None else config.tools)
        self.environment = load_environment(environment if environment is not None else config.environment)
        hub.check_push(config)  # before anything loads: a run that cannot push fails now, not at its end
        if model is None:
            check_model_source(config)
        # what the model card says of the model and prompts: named by the config, or passed in
        self.card_options = dict(model_given=model is not None, rows_given=rows is not None)
        self.config, self.loss_config = config, config.loss
        set_seed(config.seed)
        self.runtime = runtime = Runtime.start(config.devices, config.precision)
        runtime.log(config.precision)
        ranks = runtime.ranks
        if (prompts := config.rollout.prompts_per_step) % ranks.data_size:
            raise ValueError(
                f"batch_size={config.batch_size} gives {prompts} prompts per step (batch_size / group_size), which "
                f"must be divisible by the world size {ranks.data_size} (ranks / sequence_parallel): each rank samples "
                "the same number of whole groups"
            )
        if config.compile_generation and config.parallel == "fsdp" and ranks.active:
            raise ValueError(
                "compile_generation replays a CUDA graph on fixed weight addresses, but under FSDP2 the weights are "
                "gathered anew for each rollout: use parallel='ddp', or no compile_generation"
            )
        self.turn_loop = None
        if model is None:
            model, tokenizer = load_model_and_tokenizer(
                config, runtime.flash_attention(), self._check_template, tools=bool(self.tools)
            )
        elif tokenizer is None:
            raise ValueError("a model passed to GRPOTrainer needs its tokenizer")
        else:
            self._check_template(tokenizer)
        self.tokenizer = tokenizer
        self.policy = prepare_policy(model, config, runtime.device)
        self.reference = make_reference(self.policy, config.beta)
        self.modules = wrap_modules(self.policy, self.reference, self.loss_config, config, runtime)
        self.rows = rows if rows is not None else self._load_rows()
        self.reward_funcs, self.reward_names = resolve_rewards(
            reward_funcs or config.reward_funcs, config.dataset, config.task, self.environment is not None
        )
        self.data = DataOrder(self.rows, config.seed, prompts, ranks)
        self.source = self._make_source()
        self.evaluator = None
        if config.eval_every or config.eval_dataset is not None:
            eval_rows = evaluation.load_eval_rows(config, self._prompt_tokenizer, self.tool_schemas)
            # its own turn loop: the evals' tool seconds are not the training step's
            eval_loop = self.turn_loop.copy() if self.turn_loop else None
            self.evaluator = evaluation.Evaluator(
                self.policy, tokenizer, config, eval_rows, self.reward_funcs, self.reward_names, runtime, eval_loop
            )
        self.optimizer = adamw([p for p in self.policy.parameters() if p.requires_grad], config.optim)
        self.optimizer.zero_grad(set_to_none=True)  # a model handed over with gradients (a warm start's)
        self.scheduler = lr_scheduler(self.optimizer, config.optim, config.rollout)
        self.step = self.data_position = 0
        self.output_dir = ranks.broadcast(config.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
        self.history: list = []
        if ranks.data_rank:  # the model is built alike everywhere; the Hugging Face engine must not draw alike
            set_seed(config.seed + ranks.data_rank)  # (but a sequence group's ranks sample one share alike)
        self.strategy.attach(self)

    def _check_template(self, tokenizer) -> None:
        """With tools or an environment: the tokenizer's chat template must be prefix-preserving
        and render the tools (raises, naming the cause); then the rollouts' turn loop."""
        self.turn_loop = turn_loop(tokenizer, self.tools, self.environment, self.config)

    @property
    def tool_schemas(self) -> list | None:
        """The tools' JSON schemas, which every row's prompt shows; None without tools, or in an
        environment (its episodes' ``reset`` gives their prompt, which each rollout renders)."""
        return None if self.environment is not None else [tool.schema for tool in self.tools] or None

    @property
    def _prompt_tokenizer(self):
        """What formats the rows' prompts: the tokenizer, or None in an environment."""
        return None if self.environment is not None else self.tokenizer

    def _load_rows(self) -> list:
        config = self.config
        return load_rows(
            config.dataset,
            tokenizer=self._prompt_tokenizer,
            seed=config.seed,
            hold_out=evaluation.demo_holds_out(config),
            task=config.task,
            tools=self.tool_schemas,
            split=config.dataset_split,
            **config.data.prompt_options(),
        )

    def _make_source(self):
        """Where the samples come from: a worker process sampling ahead (max_staleness >= 1,
        started on the first batch; see :meth:`close`), or the engine in this process."""
        config, runtime = self.config, self.runtime
        if config.max_staleness:
            return AsyncRollouts(
                config,
                runtime,
                self.policy,
                self.reference,
                self.tokenizer,
                self.reward_funcs,
                self.data,
                self.tools,
                self.environment,
            )
        engine = make_generator(config.generator, self.policy, self.tokenizer, EngineSettings.of(config), runtime)
        return InProcessRollouts(
            engine, self.data, self.reward_funcs, config, runtime, self.modules.packed, self.tokenizer, self.turn_loop
        )

    @property
    def version(self) -> int:
        """The policy's version: the optimizer steps taken (num_iterations per training step)."""
        return self.step * self.config.num_iterations

    # ---------------------------------------------------------------- one step
    def train_step(self) -> dict:
        """One training step; returns its log line (see :meth:`run_step`)."""
        return self.run_step().metrics

    def run_step(self) -> StepResult:
        """samples -> batch -> num_iterations x (backward passes -> optimizer step -> publish)
        -> log line. A step whose samples hold no group on any rank (dynamic sampling) makes no
        update. The passes read nothing to the host; the log line reads everything once, the
        seconds of each stage (``time/*_s``) with it."""
        if self.runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.runtime.device)
        clock = PhaseClock(self.runtime.device)
        # 1. samples: G completions per prompt and their rewards, from the rollout source
        samples = self.source.next(self.data_position, self.version)
        self.data_position = samples.data_end
        clock.mark("rollout")
        # 2. the step's batch, built once: advantages, reference log-probs, micro-batches
        batch = self.prepare(samples)
        clock.mark("prepare")
        # 3. the passes: backward over the micro-batches, optimizer step, the new weights to
        #    the source. The first runs at the weights the step starts with: its log-probs are
        #    the proximal policy's, which the later passes and the sampling correction read.
        passes, proximal, correction = [], None, self.config.async_.correction_options()
        for _ in range(self.config.num_iterations if batch.stats is not None else 0):
            result = self.accumulate_gradients(batch, proximal)
            proximal = proximal or Proximal.of(result, batch, correction, self.runtime.ranks)
            passes.append(dict(result.metrics, **self.optimizer_step(result.metrics["loss"])))
            self.source.publish(self.policy, self.version + len(passes))
        clock.mark("update")
        self.step += 1
        # 4. the log line: everything the device holds, read once
        metrics = log_line(
            self.step,
            batch,
            passes,
            clock,
            self.runtime,
            learning_rate=self.scheduler.get_last_lr()[0],
            extra=dict(self.source.metrics(), **(self.strategy.metrics(batch) if passes else {})),
            sampling=proximal.metrics if proximal else {},
            dynamic_sampling=self.config.dynamic_sampling,
            reward_names=self.reward_names,
        )
        return StepResult(metrics, batch)

    def prepare(self, samples: Samples) -> StepBatch:
        """The step's batch, built once (``update/batch.py``), with the strategy's advantages."""
        batch = StepBatch(**batch_fields(samples, self.config, self.modules, self.policy, self.reference, self.runtime))
        return batch if batch.stats is None else self.strategy.prepare(batch)

    def accumulate_gradients(self, batch: StepBatch, proximal: Proximal | None) -> PassResult:
        """One pass's backward over the batch (``passes.accumulate``), then the strategy's own
        loss term's; the first (``proximal`` None) records its log-probs where a later pass or
        the sampling correction needs them."""
        record = proximal is None and (
            self.config.num_iterations > 1 or corrects(batch.samples, self.config.async_.correction_options())
        )
        result = accumulate(self.modules, batch, proximal, self.config, self.runtime.ranks, record)
        result.metrics.update(self.strategy.backward(batch))
        return result

    def optimizer_step(self, loss) -> dict:
        """Clips the gradient norm, steps the optimizer and the schedule, clears the gradients: the
        strategy's parts', each alone, then the policy's. A non-finite ``loss`` (this rank's share,
        summed over ranks here) or gradient norm skips the policy's update, a part's norm its own.
        Returns the gradient norms and the skip as device tensors (read with the step's metrics)."""
        max_norm = self.config.max_grad_norm
        parts = {
            f"{name}_grad_norm": clipped_step(part.optimizer, part.scheduler, max_norm)["grad_norm"]
            for name, part in self.strategy.parts().items()
        }
        loss = self.runtime.ranks.sum(torch.as_tensor(loss, dtype=torch.float32, device=self.runtime.device))
        return dict(clipped_step(self.optimizer, self.scheduler, max_norm, loss), **parts)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """Writes the step's checkpoint (every rank its shards; ``run/checkpoint.py``)."""
        return checkpoint.save_trainer(self)

    def resume(self, path: str | None = None, *, auto: bool = False) -> int:
        """Restores the newest checkpoint of the output dir (or ``path``), written at any world
        size; returns its step. The source learns of the restored weights' version. ``auto``:
        the newest checkpoint that passes its manifest's check (each one skipped is logged with
        its bad file), or none, and the run starts from step 0 (a job requeued forever)."""
        ranks = self.runtime.ranks
        directory = self.output_dir
        picked = auto and path is None  # rank 0 picks one that passed its manifest's check
        if path is None:
            latest = checkpoint.latest_valid_checkpoint if auto else checkpoint.latest_checkpoint
            path = ranks.broadcast(latest(directory) if ranks.is_main else None)
        if path is None and not auto:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(directory, 'checkpoints')!r}")
        if path is not None:
            checkpoint.load_trainer(self, path, verified=picked)
            self.source.publish(self.policy, self.version)
        if ranks.is_main and os.path.isdir(directory):
            run_log.truncate_metrics(directory, self.step)
        ranks.barrier()
        self.history = run_log.read_metrics(directory)
        return self.step

    def save_model(self) -> str:
        """The policy and tokenizer, with the model card, in ``<output_dir>/final``."""
        return checkpoint.save_final(self)

    # ---------------------------------------------------------------- the run
    def evaluate(self) -> dict:
        """The eval metrics of the policy now (``run/evaluation.py``; every rank its share)."""
        with distributed.gathered(self.modules.packed):
            return self.evaluator(self.version)

    def train(self) -> list:
        """Runs the remaining steps; returns the metrics of every step of the run (``run/loop.py``:
        rank 0 writes the config, metrics, completions, progress bar and plot, and reports to
        the trackers; every eval_every steps the metrics line gains the eval metrics)."""
        return loop.run(self)

    def close(self) -> None:
        """Stops the rollout worker, if one runs, and the engines' cores (vllm's, the
        evaluation's too): ``train()`` does on its way out, error or not; a caller of
        ``train_step()`` does when done. A checkpoint resumes after the trained steps: the
        batches in flight are sampled again."""
        self.source.close()
        if self.evaluator is not None:
            self.evaluator.generator.close()
