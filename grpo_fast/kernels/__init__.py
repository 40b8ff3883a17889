"""Triton kernels and their launchers, one op per file; imported lazily by ``grpo_fast.ops``.

``token_logprobs``: online log-sum-exp over the vocabulary, gather, entropy, backward.
``grpo_loss``: the token-level loss in one launch (log-probs, policy math, dL/dlogits).
``group_advantages``: per-group reward normalisation in one launch.
"""
