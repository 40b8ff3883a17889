"""Asynchronous rollouts (``max_staleness`` K >= 1): a worker process samples while the trainer trains.

    trainer (the training process)               worker (a process of its own, spawned)
    request batch b: its rows and keys  ------>  wait until the weights' version >= b * mu - K
                                                 load version b * mu - K from shared memory
                                                 sample G per prompt, score (rewards, sandbox)
                                                 sampling log-probs: the engine's, or a forward
                                                 reference log-probs of the first micro-batches,
                                                 until the trainer asks for b (it would wait)
    receive batch b  <-------------------------  (samples, their policy version, timings)
    the other rows' reference log-probs,
    advantages; the first training pass (the
    step's first weights: the proximal policy)
    applies the sampling correction from its
    own log-probs; update
    after every optimizer step: publish the
    weights (copy, version += 1)                 (an engine with its own copy, vllm, is told)

Versions count optimizer steps (mu = num_iterations per training step): step s starts at
version s * mu, so a batch sampled at version >= s * mu - K is at most K optimizer steps old.
The trainer keeps K + 1 requests ahead; the worker holds a request until the weights are
recent enough, so it never runs further ahead than K allows.

Weights travel in memory: two slots of shared-memory CPU tensors (the trainable parameters
only), each with a lock. The trainer writes the slot the newest version is not in, so it
waits only in the rare case that the worker is still copying from that slot (one copy); the
worker reads the newest slot and the version stored with it.

The correction: a worker's batch always carries its ``sampling_logprobs``, so the trainer
corrects it as it corrects the vllm engine's batches (``update/passes.py``): the step's first training
pass computes the sampled tokens' log-probs under the weights the step starts with (the
proximal policy: the clip's old log-probs) and weighs each token's (or sequence's) policy term
by the bounded ratio proximal / sampling, the loss spec's
:func:`~grpo_fast.spec.sampling_correction`, with no pass of its own.

Data and checkpoints: this source walks the data order ahead of the trainer from the position
the trainer gave it first; a request carries the rows. Each batch's ``data_end`` is the
position after its rows, which the trainer keeps as its own position once it trained on it,
so a checkpoint resumes there and the batches that were in flight are sampled again.

Failures: a worker that raises sends its traceback, and the trainer raises it; a worker that
dies without one (killed) is noticed within a poll interval. The worker dies with the
trainer (``PR_SET_PDEATHSIG`` on Linux, and a check of its parent while it waits) and ignores
SIGINT and the preemption signals: Ctrl-C, or a scheduler's signal to the whole process group,
reaches the trainer, which saves and stops the worker on its way out.

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

from grpo_fast.environments import load_environment
from grpo_fast.trainer.config import GRPOConfig
from grpo_fast.trainer.model.build import reference_context
from grpo_fast.trainer.model.packed_policy import PackedPolicy
from grpo_fast.trainer.model.packing import pack_rollout
from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator
from grpo_fast.trainer.rollout.samples import Samples, rollout
from grpo_fast.trainer.rollout.sources import RolloutSource
from grpo_fast.trainer.rollout.turns import turn_loop
from grpo_fast.trainer.runtime import Runtime

POLL_S = 0.05  # how often a waiting side checks that the other is still alive


class WeightSlots:
    """Two slots of shared-memory CPU tensors, one per trainable parameter, each with a lock,
    and the version each holds; the newest published version. The trainer writes the slot the
    newest version is not in; the worker reads the version a batch is due (or the newest)."""

    def __init__(self, params: list, version: int, context):
        self.slots = [{name: p.detach().to("cpu", copy=True).share_memory_() for name, p in params} for _ in range(2)]
        self.locks = [context.Lock(), context.Lock()]
        self.versions = context.Array("q", [version, version], lock=False)
        self.newest = context.Value("q", version, lock=False)

    def write(self, params: list, version: int) -> None:
        """Copies ``params`` ``[(name, tensor)]`` into the free slot and announces ``version``."""
        slot = version % 2
        with self.locks[slot], torch.no_grad():
            for name, p in params:
                self.slots[slot][name].copy_(p.detach())
            self.versions[slot] = version
        self.newest.value = version

    def read(self, params: dict, loaded: int, wanted: int) -> int:
        """Copies version ``wanted`` into ``params`` ``{name: tensor}``, or the newest once no
        slot holds it any more (or yet), unless that version is ``loaded``; returns the version
        ``params`` hold now."""
        # A slot overwritten between this look and its lock holds the newest: what is read then
        slot = wanted % 2 if self.versions[wanted % 2] == wanted else self.newest.value % 2
        with self.locks[slot]:
            version = self.versions[slot]
            if version != loaded:
                for name, tensor in self.slots[slot].items():
                    params[name].copy_(tensor)
        return version


@dataclasses.dataclass
class WorkerSetup:
    """What the worker process is started with (pickled by ``spawn``; tensors in shared memory)."""

    config: GRPOConfig  # the run's (the worker samples, rewards and scores as the trainer would)
    model: torch.nn.Module  # a CPU copy of the policy, moved to ``device`` in the worker
    reference: torch.nn.Module | None  # a CPU copy of the frozen reference; None: beta = 0, or below
    reference_is_policy: bool  # a peft policy: its reference is itself with the adapters off
    tokenizer: object
    reward_funcs: list
    tools: list  # the resolved Tools (functions pickle by reference); [] without tools
    environment: object  # the environment's class or name (EnvironmentFactory.spec), or None
    device: str
    bf16: bool  # the precision decided for the worker's device (Runtime.on)
    threads: int  # torch threads on CPU
    rank: int
    weights: WeightSlots
    requests: object  # queue of (batch index, rows, keys)
    stop: object  # an Event: the trainer asks the worker to stop
    results: object  # queue of ("batch", pickled (batch index, Samples, timings)) or ("error", traceback)
    parent: int  # the trainer's pid


class WorkerError(RuntimeError):
    """The rollout worker failed or died; the message holds its traceback or exit code."""


class AsyncRollouts(RolloutSource):
    """The trainer's side: starts the worker on the first batch, sends requests ahead of the
    trainer, receives batches with their sampling log-probs, publishes weights, stops the worker.

    Args:
        config: the run's config.
        runtime: the trainer's runtime (its device receives the batches).
        policy, reference: the trainer's policy and reference model (None: beta = 0), copied
            to the worker when it starts.
        tokenizer, reward_funcs: the run's.
        data: the run's :class:`~grpo_fast.trainer.rollout.data.DataOrder`.
        tools: the run's resolved tools ([] without): the worker runs the turn loop.
        environment: the run's EnvironmentFactory, or None: the worker makes its own from its spec.
    """

    def __init__(
        self,
        config,
        runtime: Runtime,
        policy,
        reference,
        tokenizer,
        reward_funcs: list,
        data,
        tools=(),
        environment=None,
    ):
        self.config, self.runtime, self.policy, self.reference = config, runtime, policy, reference
        self.tokenizer, self.reward_funcs, self.data, self.tools = tokenizer, reward_funcs, data, list(tools)
        self.environment = environment
        self.process = None
        self._metrics: dict = {}

    # ---------------------------------------------------------------- life cycle
    def start(self, position: int, version: int) -> None:
        """Starts the worker with the policy at ``version`` and requests the batches from data
        position ``position`` on."""
        config, runtime = self.config, self.runtime
        context = torch.multiprocessing.get_context("spawn")
        self.params = [(name, p) for name, p in self.policy.named_parameters() if p.requires_grad]
        self.weights = WeightSlots(self.params, version, context)
        self.requests, self.results, self.stop = context.Queue(), context.Queue(), context.Event()
        device = torch.device(config.generation_device or runtime.device)
        self.saved_threads = torch.get_num_threads()
        threads = max(1, self.saved_threads // 2)
        if device.type == "cpu" and runtime.device.type == "cpu":
            torch.set_num_threads(max(1, self.saved_threads - threads))
        separate = self.reference is not None and self.reference is not self.policy
        worker_runtime = runtime.on(device, config.precision)  # the trainer's ranks: rank 0 logs it
        worker_runtime.log(config.precision, "rollout worker")
        setup = WorkerSetup(
            config=config,
            model=copy.deepcopy(self.policy).to("cpu"),
            reference=copy.deepcopy(self.reference).to("cpu") if separate else None,
            reference_is_policy=self.reference is self.policy,
            tokenizer=self.tokenizer,
            reward_funcs=self.reward_funcs,
            tools=self.tools,
            environment=None if self.environment is None else self.environment.spec,
            device=str(device),
            bf16=worker_runtime.bf16,
            threads=threads,
            rank=runtime.ranks.data_rank,  # a sequence group's ranks sample alike
            weights=self.weights,
            requests=self.requests,
            stop=self.stop,
            results=self.results,
            parent=os.getpid(),
        )
        self.process = context.Process(target=serve, args=(setup,), name="grpo-rollout-worker", daemon=True)
        self.process.start()
        self.cursor = position  # the data position of the next request
        self.pending = collections.deque()  # the data position after each batch in flight
        first = version // config.num_iterations
        for index in range(first, first + config.max_staleness + 1):
            self._request(index)

    def close(self) -> None:
        """Stops the worker (asks: it leaves within a poll interval wherever it waits; else
        terminates, then kills) and restores the thread count. The next batch starts it again."""
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
        """Sends batch ``index``'s rows: the next rows from the request cursor."""
        rows, keys, self.cursor = self.data.take(self.cursor)
        self.pending.append(self.cursor)
        self.requests.put((index, rows, keys))

    def next(self, position: int, version: int) -> Samples:
        """The next batch on the trainer's device, with its ``sampling_logprobs`` (the weights
        that sampled it), ``policy_version`` and the reference log-probs of the rows the worker
        had time for. The first call starts the worker from ``position`` and ``version``; later
        batches follow the ones requested (the trainer's position is the last batch's end)."""
        if self.process is None:
            self.start(position, version)
        config = self.config
        start = time.perf_counter()
        index, samples, timings = self._receive()
        wait = time.perf_counter() - start
        samples.data_end = self.pending.popleft()
        self._request(index + config.max_staleness + 1)
        self._metrics = dict(
            staleness=index * config.num_iterations - samples.policy_version,
            rollout_wait_s=wait,
            weight_copy_s=0.0,
            **timings,
        )
        return samples.to(self.runtime.device)

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

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """Copies the trainer's weights into the free slot and announces ``version``."""
        if self.process is None:  # not started: the worker starts from the policy as it is then
            return
        start = time.perf_counter()
        self.weights.write(self.params, version)
        self._metrics["weight_copy_s"] = self._metrics.get("weight_copy_s", 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        """The batch's staleness, the trainer's wait for it, the weight copies since, the worker's timings."""
        return dict(self._metrics)


# -------------------------------------------------------------------- the worker process
def serve(setup: WorkerSetup) -> None:
    """The worker's main: serves requests until told to stop; any error goes to the trainer."""
    for name in {"SIGINT", *setup.config.preemption_signals}:  # the trainer's to act on, and it stops the worker
        signal.signal(signal.Signals[name], signal.SIG_IGN)
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
    """Samples and scores the requested batches, each at the weights it is due (``_load``)."""

    def __init__(self, setup: WorkerSetup):
        self.setup, config = setup, setup.config
        torch.set_grad_enabled(False)  # this process only samples and scores
        self.device = torch.device(setup.device)
        if self.device.type == "cpu":
            torch.set_num_threads(setup.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        transformers.set_seed(config.seed + setup.rank)  # the Hugging Face engine draws from torch's generator
        runtime = Runtime(self.device, bf16=setup.bf16)
        self.model = setup.model.to(self.device)
        self.params = dict(self.model.named_parameters())
        self.loaded = -1
        # Before the engine: the model's config names the packed attention (pickled with it),
        # which PackedPolicy registers in this process before any forward looks it up.
        self.packed = PackedPolicy(self.model, config.loss, runtime)
        self.generator = make_generator(
            config.generator, self.model, setup.tokenizer, EngineSettings.of(config), runtime
        )
        self.turn_loop = turn_loop(setup.tokenizer, setup.tools, load_environment(setup.environment), config)
        self.reference, self.reference_packed = None, None
        if setup.reference_is_policy:
            self.reference, self.reference_packed = self.model, self.packed
        elif setup.reference is not None:
            self.reference = setup.reference.to(self.device)
            self.reference_packed = PackedPolicy(self.reference, config.loss, runtime)

    def run(self) -> None:
        setup, config = self.setup, self.setup.config
        while (request := self._wait_for_request()) is not None:
            index, rows, keys = request
            start = time.perf_counter()
            due = index * config.num_iterations - config.max_staleness
            while setup.weights.newest.value < due:
                if not self._running():
                    return
                time.sleep(POLL_S / 10)
            weight_wait = time.perf_counter() - start
            self._load(due)
            start = time.perf_counter()
            samples = rollout(
                self.generator,
                rows,
                keys,
                setup.reward_funcs,
                group_size=config.group_size,
                keep_logprobs=True,
                turns=self.turn_loop,
            )
            micro = self._micro_batches(samples)  # as the trainer will pack it
            if samples.sampling_logprobs is None:
                samples.sampling_logprobs = self._logprobs(micro)
            rollout_s = time.perf_counter() - start
            samples.ref_logprobs = self._reference_logprobs(micro, index)
            samples.policy_version = self.loaded
            done = 0 if samples.ref_logprobs is None else samples.ref_logprobs.shape[0]
            timings = dict(
                worker_weight_wait_s=weight_wait,
                worker_rollout_s=rollout_s,
                worker_reference_share=done / max(samples.input_ids.shape[0], 1),
                **self.generator.metrics(),
                **(self.turn_loop.metrics() if self.turn_loop else {}),
            )
            samples = samples.to("cpu")
            # Plain pickle: the tensors' bytes travel in the message (a few KB a row), not as
            # shared-memory handles that a worker dying before they are read would take along.
            setup.results.put(("batch", pickle.dumps((index, samples, timings))))

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

    def _load(self, due: int) -> None:
        """Copies the weights of version ``due`` into the model (the newest once that version's
        slot was overwritten, or before the run's first), if not loaded yet, and tells the
        engine (one with its own copy of them, vllm, reloads). A batch sampled at the version
        it is due, not at whichever is newest when the worker gets to it, is the same batch
        however the two processes are scheduled: at K = 1 always (the slots hold the newest
        version and the one before, and the newest is at most the due one + 1), so a run, and
        its resumption, repeat bit for bit; at K >= 2 while the worker keeps up."""
        self.loaded = self.setup.weights.read(self.params, self.loaded, due)
        self.generator.publish(self.loaded)

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
                if setup.weights.newest.value >= ready or setup.stop.is_set():
                    break
                out.append(self.reference_packed(packed))
        return torch.cat(out) if out else None

    def _micro_batches(self, batch: Samples) -> list:
        """The batch packed as the trainer packs it."""
        C = batch.completion_mask.shape[1]
        return pack_rollout(batch.input_ids, batch.attention_mask, C, self.setup.config, self.generator.model)

    def _logprobs(self, micro: list) -> torch.Tensor:
        """The sampled tokens' log-probs [N, C] under the weights that sampled them (for an
        engine that does not return them): one packed forward per micro-batch of ``micro``."""
        return torch.cat([self.packed(packed) for packed in micro])
