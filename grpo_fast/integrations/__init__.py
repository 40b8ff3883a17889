"""Adapters for other trainers; each imports its framework when it is imported, never before.

- ``grpo_fast.integrations.trl``: ``GRPOTrainer``, TRL's trainer with grpo_fast's fused loss.
- ``grpo_fast.integrations.trl_support``: the TRL releases and internals that the TRL adapter
  is written against, checked when the adapter is imported.
- ``grpo_fast.integrations.verl``: grpo_fast's policy losses in verl's registry and its fused
  LM head as verl's ``FusedLinearForPPO``.
"""
