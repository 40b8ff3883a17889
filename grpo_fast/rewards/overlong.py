"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

With L_max = max_length, L_cache = buffer_length and |y| the completion length in tokens:
    0                                   if |y| <= L_max - L_cache
    (L_max - L_cache - |y|) / L_cache   if L_max - L_cache < |y| <= L_max   (0 down to -1)
    -1                                  if |y| > L_max
It is added to the task reward, so completions that approach the generation limit lose
reward smoothly instead of being truncated into noise.
"""

from grpo_fast.rewards.base import check_batch, completion_texts


def overlong_penalty(
    prompts: list[str],
    completions: list[str],
    *,
    max_length: int | None = None,
    buffer_length: int | None = None,
    completion_ids: list | None = None,
    tokenizer=None,
    **columns,
) -> list[float]:
    """The soft overlong penalty in [-1, 0] for each completion.

    prompts, completions: N strings.
    max_length: L_max, the generation limit in tokens. buffer_length: L_cache, 0 < L_cache <= L_max.
        Bind both with functools.partial(overlong_penalty, max_length=..., buffer_length=...).
    completion_ids: N token-id lists (|y| = their lengths); else `tokenizer` encodes the
        completions (without special tokens). One of the two is required.
    """
    if not isinstance(max_length, int) or not isinstance(buffer_length, int) or not 0 < buffer_length <= max_length:
        raise ValueError(
            "overlong_penalty needs integers 0 < buffer_length <= max_length (bind them with "
            f"functools.partial), got max_length={max_length!r}, buffer_length={buffer_length!r}"
        )
    if completion_ids is not None:
        check_batch(prompts, completions, {"completion_ids": completion_ids, **columns})
        lengths = [len(ids) for ids in completion_ids]
    elif tokenizer is not None:
        check_batch(prompts, completions, columns)
        lengths = [len(tokenizer.encode(c, add_special_tokens=False)) for c in completion_texts(completions)]
    else:
        raise ValueError(
            "overlong_penalty needs completion_ids=[N token-id lists] or tokenizer= to measure "
            "completion lengths in tokens"
        )
    start = max_length - buffer_length
    return [max(-1.0, min(0.0, (start - n) / buffer_length)) if n <= max_length else -1.0 for n in lengths]
