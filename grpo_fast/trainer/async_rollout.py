"""Asynchronous rollouts (``max_staleness`` K >= 1): a worker process samples while the trainer trains.

    trainer (the training process)               worker (a process of its own, spawned)
    request batch b: its rows and keys  ------>  wait until the weights' version >= b * mu - K
                                                 load the newest weights from shared memory
                                                 sample G per prompt, score (rewards, sandbox)
                                                 sampling log-probs: the engine's, or a forward
                                                 reference log-probs of the first micro-batches,
                                                 until the trainer asks for b (it would wait)
    receive batch b  <-------------------------  (rollout, its policy version, timings)
    the other rows' reference log-probs,
    advantages; the first training pass (the
    step's first weights: the proximal policy)
    applies the sampling correction from its
    own log-probs; update
    after every optimizer step: publish the
    weights (copy, version += 1)

Versions count optimizer steps (mu = num_iterations per training step): step s starts at
version s * mu, so a batch sampled at version >= s * mu - K is at most K optimizer steps old.
The trainer keeps K + 1 requests ahead; the worker holds a request until the weights are
recent enough, so it never runs further ahead than K allows.

Weights travel in memory: two slots of shared-memory CPU tensors (the trainable parameters
only), each with a lock. The trainer writes the slot the newest version is not in, so it
waits only in the rare case that the worker is still copying from that slot (one copy); the
worker reads the newest slot and the version stored with it.

The correction: a worker's batch always carries its ``sampling_logprobs``, so the trainer
corrects it as it corrects the vllm engine's batches (``GRPOTrainer.corrects``): the step's
first training pass computes the sampled tokens' log-probs under the weights the step starts
with (the proximal policy: the clip's old log-probs) and weighs each token's (or sequence's)
policy term by the bounded ratio proximal / sampling, the loss spec's
:func:`~grpo_fast.spec.sampling_correction`, with no pass of its own.

Data and checkpoints: the trainer alone walks the data order; a request carries the rows. Its
``data_position`` is the position after the last batch it trained on, so a checkpoint
resumes there and the batches that were in flight are sampled again.

Failures: a worker that raises sends its traceback, and the trainer raises it; a worker that
dies without one (killed) is noticed within a poll interval. The worker dies with the
trainer (``PR_SET_PDEATHSIG`` on Linux, and a check of its parent while it waits) and ignores
SIGINT: Ctrl-C reaches the trainer, which stops the worker on its way out.

Where workers live: one per training process, on ``generation_device`` (default the trainer's
device; under torchrun each rank's worker samples that rank's share of the prompts). On CPU the
worker takes half of the trainer's torch threads (at least one each).
"""

import collections
import copy
import ctypes
import dataclasses
import os
import pickle
import queue
import signal
import sys
import time
import traceback

import torch
import transformers

from grpo_fast.trainer.generators import make_generator
from grpo_fast.trainer.packed_policy import PackedPolicy
from grpo_fast.trainer.packing import pack_micro_batches
from grpo_fast.trainer.rollout import Rollout, reference_context, rollout

POLL_S = 0.05  # how often a waiting side checks that the other is still alive


@dataclasses.dataclass
class WorkerSetup:
    """What the worker process is started with (pickled by ``spawn``; tensors in shared memory)."""

    config: object  # the run's GRPOConfig
    model: torch.nn.Module  # a CPU copy of the policy, moved to ``device`` in the worker
    reference: torch.nn.Module | None  # a CPU copy of the frozen reference; None: beta = 0, or below
    reference_is_policy: bool  # a peft policy: its reference is itself with the adapters off
    tokenizer: object
    reward_funcs: list
    device: str
    threads: int  # torch threads on CPU
    bf16: bool
    rank: int
    slots: list  # two {name: shared CPU tensor} of the trainable parameters
    locks: list  # a lock per slot
    slot_versions: object  # shared int64 [2]: the version each slot holds
    version: object  # shared int64: the newest published version
    requests: object  # queue of (batch index, rows, keys)
    stop: object  # an Event: the trainer asks the worker to stop
    results: object  # queue of ("batch", pickled (batch index, Rollout, timings)) or ("error", traceback)
    parent: int  # the trainer's pid


class WorkerError(RuntimeError):
    """The rollout worker failed or died; the message holds its traceback or exit code."""


class AsyncRollouts:
    """The trainer's side: starts the worker on the first batch, sends requests, receives
    batches with their sampling log-probs, publishes weights, stops the worker.

    Args:
        trainer: the :class:`~grpo_fast.trainer.GRPOTrainer` (its policy, data order,
            packed log-prob pass and config).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.process = None
        self.metrics: dict = {}

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        trainer, config = self.trainer, self.trainer.config
        context = torch.multiprocessing.get_context("spawn")
        version = trainer.step * config.num_iterations
        self.params = [(name, p) for name, p in trainer.policy.named_parameters() if p.requires_grad]
        self.slots = [
            {name: p.detach().to("cpu", copy=True).share_memory_() for name, p in self.params} for _ in range(2)
        ]
        self.locks = [context.Lock(), context.Lock()]
        self.slot_versions = context.Array("q", [version, version], lock=False)
        self.version = context.Value("q", version, lock=False)
        self.requests, self.results, self.stop = context.Queue(), context.Queue(), context.Event()
        device = torch.device(config.generation_device or trainer.device)
        self.saved_threads = torch.get_num_threads()
        threads = max(1, self.saved_threads // 2)
        if device.type == "cpu" and trainer.device.type == "cpu":
            torch.set_num_threads(max(1, self.saved_threads - threads))
        # The trainable tensors stay marked so: an engine that follows the policy (vllm) watches
        # their version counters to know when to reload. The worker never computes a gradient.
        model = copy.deepcopy(trainer.policy).to("cpu")
        separate = trainer.reference is not None and trainer.reference is not trainer.policy
        setup = WorkerSetup(
            config=config,
            model=model,
            reference=copy.deepcopy(trainer.reference).to("cpu") if separate else None,
            reference_is_policy=trainer.reference is trainer.policy,
            tokenizer=trainer.tokenizer,
            reward_funcs=trainer.reward_funcs,
            device=str(device),
            threads=threads,
            bf16=config.bf16(device),
            rank=trainer.ranks.rank,
            slots=self.slots,
            locks=self.locks,
            slot_versions=self.slot_versions,
            version=self.version,
            requests=self.requests,
            stop=self.stop,
            results=self.results,
            parent=os.getpid(),
        )
        self.process = context.Process(target=serve, args=(setup,), name="grpo-rollout-worker", daemon=True)
        self.process.start()
        self.cursor = trainer.data_position
        self.pending = collections.deque()  # the data position after each batch in flight
        for index in range(trainer.step, trainer.step + config.max_staleness + 1):
            self._request(index)

    def close(self) -> None:
        """Stops the worker (asks: it leaves within a poll interval wherever it waits; else
        terminates, then kills) and restores the thread count."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.is_alive():
            self.stop.set()  # seen within a poll interval wherever the worker waits
            process.join(5)
        if process.is_alive():
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()
        torch.set_num_threads(self.saved_threads)

    # ---------------------------------------------------------------- batches
    def _request(self, index: int) -> None:
        """Sends batch ``index``'s rows: the trainer's next rows from the request cursor (its
        own data_position stays at the trained batches' end)."""
        trainer = self.trainer
        trained = trainer.data_position
        trainer.data_position = self.cursor
        rows, keys = trainer.next_rows()
        self.cursor, trainer.data_position = trainer.data_position, trained
        self.pending.append(self.cursor)
        self.requests.put((index, rows, keys))

    def next(self) -> Rollout:
        """The next step's batch on the trainer's device, with its ``sampling_logprobs`` (the
        weights that sampled it), ``policy_version`` and the reference log-probs of the rows
        the worker had time for; the step's first training pass then applies the sampling
        correction, as to any batch with sampling log-probs."""
        if self.process is None:
            self.start()
        trainer, config = self.trainer, self.trainer.config
        start = time.perf_counter()
        index, batch, timings = self._receive()
        wait = time.perf_counter() - start
        trainer.data_position = self.pending.popleft()
        self._request(index + config.max_staleness + 1)
        self.metrics = dict(
            staleness=index * config.num_iterations - batch.policy_version,
            rollout_wait_s=wait,
            weight_copy_s=0.0,
            **timings,
        )
        return to_device(batch, trainer.device)

    def _receive(self) -> tuple:
        """The worker's next message; WorkerError when it sent an error or died."""
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    try:  # an error it sent just before exiting may still be in the pipe
                        message = self.results.get(timeout=1.0)
                        break
                    except queue.Empty:
                        code = self.process.exitcode
                        raise WorkerError(f"the rollout worker died (exit code {code}) without an error message")
        if message[0] == "error":
            raise WorkerError(f"the rollout worker failed:\n{message[1]}")
        return pickle.loads(message[1])

    def publish(self) -> None:
        """Copies the trainer's weights into the free slot and announces the next version."""
        start = time.perf_counter()
        version = self.version.value + 1
        slot = version % 2
        with self.locks[slot], torch.no_grad():
            for name, p in self.params:
                self.slots[slot][name].copy_(p.detach())
            self.slot_versions[slot] = version
        self.version.value = version
        self.metrics["weight_copy_s"] = self.metrics.get("weight_copy_s", 0.0) + time.perf_counter() - start


def to_device(batch: Rollout, device: torch.device) -> Rollout:
    """The rollout with its tensors on ``device``."""
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


# -------------------------------------------------------------------- the worker process
def serve(setup: WorkerSetup) -> None:
    """The worker's main: serves requests until told to stop; any error goes to the trainer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops the worker
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer
    try:
        Worker(setup).run()
    except BaseException:
        setup.results.put(("error", traceback.format_exc()))
        sys.exit(1)
    # Stopped: leave without the interpreter's teardown, whose final garbage collection (torch's
    # and the model's objects) takes seconds that the trainer's join would wait; there is nothing
    # to write (a batch still in the pipe has no reader now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Worker:
    """Samples and scores the requested batches with the newest published weights."""

    def __init__(self, setup: WorkerSetup):
        self.setup, config = setup, setup.config
        torch.set_grad_enabled(False)  # this process only samples and scores
        self.device = torch.device(setup.device)
        if self.device.type == "cpu":
            torch.set_num_threads(setup.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        transformers.set_seed(config.seed + setup.rank)  # the Hugging Face engine draws from torch's generator
        self.model = setup.model.to(self.device)
        self.params = dict(self.model.named_parameters())
        self.loaded = -1
        self.generator = make_generator(config.generator, self.model, setup.tokenizer, config, bf16=setup.bf16)
        self.packed = PackedPolicy(self.model, config.loss_config(), bf16=setup.bf16)
        self.reference, self.reference_packed = None, None
        if setup.reference_is_policy:
            self.reference, self.reference_packed = self.model, self.packed
        elif setup.reference is not None:
            self.reference = setup.reference.to(self.device)
            self.reference_packed = PackedPolicy(self.reference, config.loss_config(), bf16=setup.bf16)

    def run(self) -> None:
        setup, config = self.setup, self.setup.config
        while (request := self._wait_for_request()) is not None:
            index, rows, keys = request
            start = time.perf_counter()
            while setup.version.value < index * config.num_iterations - config.max_staleness:
                if not self._running():
                    return
                time.sleep(POLL_S / 10)
            weight_wait = time.perf_counter() - start
            self._load_newest()
            start = time.perf_counter()
            batch = rollout(
                self.generator, rows, keys, setup.reward_funcs, group_size=config.group_size, keep_logprobs=True
            )
            micro = self._micro_batches(batch)  # as the trainer will pack it
            if batch.sampling_logprobs is None:
                batch = dataclasses.replace(batch, sampling_logprobs=self._logprobs(micro))
            rollout_s = time.perf_counter() - start
            batch = dataclasses.replace(batch, ref_logprobs=self._reference_logprobs(micro, index))
            done = 0 if batch.ref_logprobs is None else batch.ref_logprobs.shape[0]
            batch = dataclasses.replace(to_device(batch, torch.device("cpu")), policy_version=self.loaded)
            timings = dict(
                worker_weight_wait_s=weight_wait,
                worker_rollout_s=rollout_s,
                worker_reference_share=done / max(batch.input_ids.shape[0], 1),
            )
            # Plain pickle: the tensors' bytes travel in the message (a few KB a row), not as
            # shared-memory handles that a worker dying before they are read would take along.
            setup.results.put(("batch", pickle.dumps((index, batch, timings))))

    def _wait_for_request(self):
        """The next request, or None once the trainer asked to stop."""
        while self._running():
            try:
                return self.setup.requests.get(timeout=POLL_S)
            except queue.Empty:
                pass
        return None

    def _running(self) -> bool:
        """False once the trainer asked to stop; exits if the trainer is gone (where
        PR_SET_PDEATHSIG is not available)."""
        if os.getppid() != self.setup.parent:
            raise SystemExit(0)
        return not self.setup.stop.is_set()

    def _load_newest(self) -> None:
        """Copies the newest slot into the model, when it holds a version not loaded yet."""
        setup = self.setup
        slot = setup.version.value % 2
        with setup.locks[slot]:
            version = setup.slot_versions[slot]
            if version != self.loaded:
                for name, tensor in setup.slots[slot].items():
                    self.params[name].copy_(tensor)
                self.loaded = version

    def _reference_logprobs(self, micro: list, index: int) -> torch.Tensor | None:
        """The reference log-probs [k, C] of batch ``index``'s first k rows, or None: its
        micro-batches ``micro`` (the trainer's packing), one after another, for as long as the
        worker would otherwise wait, i.e. until the trainer asks for this batch (its step
        starts at version index * mu) or the next batch may be sampled; the trainer computes
        the other rows. So the pass
        moves to whichever side has the time, and a row's values do not depend on which
        (the same packing, the same micro-batch)."""
        if self.reference_packed is None:
            return None
        setup, config = self.setup, self.setup.config
        ready = min(index * config.num_iterations, (index + 1) * config.num_iterations - config.max_staleness)
        out = []
        with reference_context(self.model, self.reference):
            for packed in micro:
                if setup.version.value >= ready or setup.stop.is_set():
                    break
                out.append(self.reference_packed(packed))
        return torch.cat(out) if out else None

    def _micro_batches(self, batch: Rollout) -> list:
        """The batch packed as the trainer packs it."""
        config = self.setup.config
        return pack_micro_batches(
            batch.input_ids,
            batch.attention_mask,
            batch.completion_mask.shape[1],
            config.max_tokens_per_micro_batch,
            config.micro_batch_size,
        )

    def _logprobs(self, micro: list) -> torch.Tensor:
        """The sampled tokens' log-probs [N, C] under the weights that sampled them (for an
        engine that does not return them): one packed forward per micro-batch of ``micro``."""
        return torch.cat([self.packed(packed) for packed in micro])
