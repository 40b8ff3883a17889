"""How a run packs its rollouts: the layout a run's model takes (the layout itself, and the
attention that runs it, are :mod:`grpo_fast.packing`'s)."""

from grpo_fast.packing import PackCost, pack_micro_batches, shared_layout_blocker


def shared_group_size(config, model) -> int | None:
    """The ``group_size`` that packs ``model``'s passes with each group's prompt once
    (``config.shared_prefix``), or None: off, or :func:`shared_layout_blocker` names why the
    model cannot take the layout (logged once)."""
    if not config.shared_prefix or shared_layout_blocker(model) is not None:
        return None
    return config.group_size


def pack_rollout(input_ids, attention_mask, num_completion_tokens: int, config, model) -> list:
    """A rollout packed as a run packs it for ``model``: :func:`pack_micro_batches` under the
    config's token and row limits, each group's prompt once where :func:`shared_group_size`
    says so and :class:`PackCost` predicts it pays, attended by the config's
    ``attention_kernel``. The trainer and the rollout worker both pack with it, so their packs
    agree."""
    return pack_micro_batches(
        input_ids,
        attention_mask,
        num_completion_tokens,
        config.max_tokens_per_micro_batch,
        config.micro_batch_size,
        shared_group_size(config, model),
        config.attention_kernel,
        PackCost.of(model, input_ids.device),
    )
