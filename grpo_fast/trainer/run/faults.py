"""What a run does when its cluster stops it or its numbers go bad (the whole fault matrix, with
the test of each row, is ``docs/reliability.md``).

Preemption. A signal of ``preemption_signals`` (SIGTERM, what SLURM sends at the time limit and
Kubernetes on eviction; SIGUSR1, SLURM's ``--signal=USR1@90``) asks the run to stop:

    1. the step in progress finishes; in one process, a step that has not reached its optimizer
       step ``preemption_grace_s`` after the signal is dropped instead (under torchrun the step
       always finishes: a rank leaving it would leave the others waiting in a collective);
    2. the run writes the checkpoint of its last finished step (a dropped step leaves nothing
       behind: the data position and RNG states go back to where it started, so the checkpoint
       is the one a periodic save of the step before writes);
    3. the rollout source stops (the asynchronous worker, the vLLM engine), and the run raises
       :class:`Preempted`; ``grpo-fast train`` exits with :data:`PREEMPTED_EXIT` (75, EX_TEMPFAIL
       of sysexits.h) for the job script or pod policy to requeue on, and ``--resume auto``
       continues bit for bit as from a periodic checkpoint.

Under torchrun each rank asks, after every step, whether any rank was signalled (one all-reduce
of a flag), so a signal to one rank, or to the launcher (which passes SIGTERM on to every rank),
makes every rank save the same step.

Non-finite numbers. A step whose loss or gradient norm is NaN or infinite is skipped
(``update/optimization.py``) and counted as ``nonfinite_steps`` in its log line;
:class:`NonFiniteGuard` stops the run after ``max_nonfinite_steps`` such steps in a row. A
checkpoint never holds a non-finite weight (``checkpoint.py`` refuses to write one).
"""

import logging
import signal
import threading

from grpo_fast.trainer.run import checkpoint

logger = logging.getLogger("grpo_fast")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "a temporary failure; the user is invited to retry"


class Preempted(Exception):
    """The run stopped on a preemption signal after writing the checkpoint ``path`` of ``step``."""

    exit_status = PREEMPTED_EXIT

    def __init__(self, signal_name: str, step: int, path: str, dropped: bool):
        self.signal_name, self.step, self.path, self.dropped = signal_name, step, path, dropped
        dropped_note = ", the step in progress dropped after the grace time" if dropped else ""
        super().__init__(
            f"preempted by {signal_name}: checkpoint of step {step} in {path}{dropped_note}; "
            f"exit {PREEMPTED_EXIT}, continue with --resume auto"
        )


class NonFiniteSteps(RuntimeError):
    """``max_nonfinite_steps`` steps in a row had a NaN or infinite loss or gradient norm."""


class _DropStep(BaseException):
    """Raised in the main thread when the grace time ends before the step's optimizer step (a
    BaseException, as KeyboardInterrupt: no ``except Exception`` on its way may swallow it)."""


class Preemption:
    """The preemption signals' handlers around a run (a context manager: the previous handlers
    come back on exit), and the step runner that can drop a step.

    A process that is not in its main thread cannot take signals: it runs without the handlers,
    and says so once.
    """

    def __init__(self, trainer):
        checkpoints = trainer.config.checkpoint
        self.trainer, self.grace = trainer, checkpoints.preemption_grace_s
        self.signals = [signal.Signals[name] for name in checkpoints.preemption_signals]
        self.optimizers = [trainer.optimizer, *(part.optimizer for part in trainer.strategy.parts().values())]
        self.received = 0  # the first preemption signal this process took (0: none)
        self.dropped = False
        self._agreed = 0  # the largest signal number any rank took, after requested()
        self._droppable = False  # in a step whose optimizers have not stepped yet
        self._previous: dict = {}
        self._hooks: list = []

    def __enter__(self) -> "Preemption":
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            logger.info("preemption signals are not handled: the run is not in the main thread")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_grace_end)
        self._hooks = [optimizer.register_step_pre_hook(self._on_optimizer_step) for optimizer in self.optimizers]
        return self

    def __exit__(self, *exc) -> None:
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for hook in self._hooks:
            hook.remove()
        self._previous, self._hooks = {}, []

    def _on_signal(self, signum, frame) -> None:
        if self.received:
            return
        self.received = signum
        ranks = self.trainer.runtime.ranks
        logger.warning(
            "rank %d: %s received; the run saves and stops after the step in progress",
            ranks.rank,
            signal.Signals(signum).name,
        )
        if ranks.world_size == 1:
            signal.setitimer(signal.ITIMER_REAL, max(self.grace, 1e-3))  # 0 would disarm the timer

    def _on_grace_end(self, signum, frame) -> None:
        if self._droppable:
            raise _DropStep

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._droppable = False  # from here on the weights change: the step must finish

    def run_step(self):
        """``trainer.run_step()``, or None when the grace time ended before its optimizer step:
        then the data position and RNG states are back where the step began."""
        trainer = self.trainer
        position, rng = trainer.data_position, checkpoint.rng_state()
        self._droppable = True
        try:
            return trainer.run_step()
        except _DropStep:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            trainer.data_position = position
            checkpoint.set_rng_state(rng)
            self.dropped = True
            logger.warning(
                "the step after %d did not reach its optimizer step in %g s: dropped", trainer.step, self.grace
            )
            return None
        finally:
            self._droppable = False

    def requested(self) -> bool:
        """Whether any rank took a preemption signal (every rank calls it after each step: one
        all-reduce, of the signal's number, so that every rank can name it)."""
        self._agreed = self.trainer.runtime.ranks.max(int(self.received))
        return bool(self._agreed)

    def stop(self, saved: int | None) -> Preempted:
        """Writes the checkpoint of the trainer's step (unless ``saved``, the step of the run's
        last checkpoint, is it) and returns the :class:`Preempted` to raise."""
        trainer = self.trainer
        path = checkpoint.checkpoint_path(trainer.output_dir, trainer.step)
        if saved != trainer.step:
            path = trainer.save_checkpoint()
        return Preempted(signal.Signals(self._agreed).name, trainer.step, path, self.dropped)


class NonFiniteGuard:
    """Counts the steps in a row whose log line has ``nonfinite_steps``; past ``limit`` raises."""

    def __init__(self, limit: int):
        self.limit, self.steps = limit, []

    def check(self, metrics: dict) -> None:
        self.steps = self.steps + [metrics["step"]] if metrics["nonfinite_steps"] else []
        if len(self.steps) >= self.limit:
            raise NonFiniteSteps(
                f"steps {self.steps[0]} to {self.steps[-1]} ({len(self.steps)} in a row, max_nonfinite_steps="
                f"{self.limit}) had a NaN or infinite loss or gradient norm and were skipped; the weights are those "
                "before them, and no checkpoint holds a non-finite weight"
            )
