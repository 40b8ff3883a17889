"""The update side: what a step makes of its samples, up to the optimizer step and the log line.

    batch.py          StepBatch: group advantages, the reference pass, packed micro-batches, built once
    strategy.py       Strategy: where the loss's advantages come from, what trains beside the policy
    passes.py         a training pass: backward over the micro-batches, the proximal log-probs and
                      the sampling correction of the first pass
    optimization.py   AdamW, the LR schedule, one clipped optimizer step
    metrics.py        the step's log line, read from the device once

May import: the trainer's core (``config``, ``choices``, ``runtime``, ``distributed``), the
model side (``trainer/model/``: the packed forward and loss), the rollout side's
:class:`~grpo_fast.trainer.rollout.samples.Samples` (what it consumes), ``grpo_fast`` below
the trainer (ops, spec). Never the run side, nor ``grpo.py``.
"""
