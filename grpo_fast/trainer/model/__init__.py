"""The policy as every pass runs it: building it, packing its inputs, its forward with the loss.

    build.py          the policy and tokenizer (a Hub name, a folder, or a built-in task's), LoRA,
                      gradient checkpointing, the frozen reference, the modules wrapped for the
                      job (DDP or FSDP2)
    packing.py        how a run packs its rollouts for its model (whole rows, or each group's
                      prompt once); the layout and its attention are ``grpo_fast/packing/``'s
    packed_policy.py  the packed forward and its loss as one module (what DDP wraps, FSDP2 shards)

Training, the reference pass, the old-log-prob pass and a rollout worker's passes all run
these, so both the rollout and the update side import this folder.

May import: the trainer's core (``config``, ``choices``, ``runtime``, ``distributed``),
``grpo_fast`` below the trainer (ops, spec, tasks for a built-in task's model). Never the
rollout, update or run sides.
"""
