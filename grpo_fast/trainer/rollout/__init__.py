"""The rollout side: where and how a step's samples come from.

A step asks its rollout source for the next batch (``sources.py``: in this process, or
``worker.py``: a worker process sampling ahead, ``max_staleness`` >= 1); the source walks the
run's data order (``data.py``), samples G completions of each prompt with a generation engine
(``engines/``: our sampler, Hugging Face ``generate``, vLLM), runs the tool loop between a
multi-turn rollout's turns (``tool_turns.py``) and scores the completions with the reward
functions (``samples.py``: :class:`~grpo_fast.trainer.rollout.samples.Samples`, what every
source returns and the update side reads).

May import: the trainer's core (``config``, ``choices``, ``runtime``, ``distributed``), the
model side (``trainer/model/``: the worker's packed forwards), ``grpo_fast`` below the trainer
(ops, tools, tasks). Never the update or run sides, nor ``grpo.py``.
"""
