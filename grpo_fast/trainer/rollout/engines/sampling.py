"""Token sampling with counter-based random numbers: the draw is a function of its identity.

A sample's random number at a token position is a hash of ``(seed, key, sample, position)``
(``key`` is the prompt's data position, ``sample`` its index within the group), computed
with integer tensor ops, so the same sample gets the same numbers whatever else is in the
batch, in whatever order, on however many ranks; and dropping finished rows from a batch
cannot shift another row's stream, as it would with one shared generator.

The hash is MurmurHash3's 32-bit finaliser ``fmix32`` applied sponge-like to the words of the
identity. It runs in int64 on values below 2^32; a 32-bit product is split into 16-bit
halves so that nothing overflows (signed overflow is undefined behaviour in the kernels).

One uniform per token suffices: the token is drawn by inverting the cumulative
distribution of the (temperature-scaled, top-k / top-p filtered) probabilities, summed in
float64:

    token = min { i : cdf[i] > u * cdf[V - 1] },    cdf = cumsum(p)

Every op works row by row (softmax, sort, cumsum, searchsorted), so a row's token depends
on its logits and its uniform only.
"""

import torch

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x2545F491  # keeps seed 0 from starting the sponge at fmix32(0) = 0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, with no
    intermediate above 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection of [0, 2^32) with full avalanche; int64 in and out."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: torch.Tensor) -> tuple:
    """The low and high 32-bit words of non-negative int64 values."""
    return x & _MASK32, (x >> 32) & _MASK32


def sample_streams(seed: int, keys: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """Each row's stream state, a hash of ``(seed, key, sample)``: [n] int64 in [0, 2^32).

    Args:
        seed: the run's seed, an int in [0, 2^63).
        keys: [n] int64 >= 0, each row's prompt key (its data position).
        samples: [n] int64 >= 0, each row's sample index within its group.
    """
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
    keys = keys.long()
    h = torch.full_like(keys, (seed & _MASK32) ^ _SEED_SALT)
    for word in (torch.full_like(keys, seed >> 32), *_words(keys), samples.long() & _MASK32):
        h = fmix32(h ^ word)
    return h


def stream_uniforms(streams: torch.Tensor, position) -> torch.Tensor:
    """The uniforms in (0, 1) of the streams [n] at a token position (an int, or [n] int64: each
    row's own): [n] float64."""
    return (fmix32(streams ^ (position & _MASK32)).double() + 0.5) / 2.0**32


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0):
    """Top-k, then top-p (nucleus) filtering, Hugging Face's order and semantics.

    Args:
        logits: [n, V] float, already divided by the temperature.
        top_k: keep the k largest logits per row (ties with the k-th kept too); 0 = all.
        top_p: keep the most likely tokens whose probability mass before them is < top_p
            (the first always); 1 = all.

    Returns:
        ``(candidates [n, V'], order)``: the filtered logits (-inf where removed) and, when
        they were sorted (top_p < 1), ``order [n, V']`` mapping a column to its token id;
        else ``order`` is None and column = token id.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p >= 1.0:
        return logits, None
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    return ordered.masked_fill(mass_before >= top_p, float("-inf")), order


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
):
    """Draws one token per row by inverse-CDF sampling with the given uniforms.

    Args:
        logits: [n, V] any float dtype.
        uniforms: [n] float64 in (0, 1) (:func:`stream_uniforms`).
        temperature: > 0; the logits are divided by it.
        top_k, top_p: see :func:`filter_logits`.

    Returns:
        ``(tokens [n] int64, logprobs [n] float32)``; the log-probs are those of the
        temperature-scaled distribution before filtering, the quantity the loss recomputes.
    """
    scaled = logits.float() / temperature
    logprobs = scaled.log_softmax(-1)
    candidates, order = filter_logits(scaled, top_k=top_k, top_p=top_p)
    probs = logprobs.exp() if candidates is scaled else candidates.softmax(-1)  # unfiltered: reuse
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    column = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    tokens = column if order is None else order.gather(1, column)
    return tokens.squeeze(1), logprobs.gather(1, tokens).squeeze(1)
