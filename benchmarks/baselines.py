"""Every implementation an op benchmark times, as closures over one batch: ours and what a
user would write without grpo_fast. Shared by bench_ops.py (CPU, fresh process per case),
the pytest-benchmark suite (test_bench_ops.py) and benchmarks/gpu/bench_kernels.py.

- ``plain``: the strongest plain code: float32 ``log_softmax`` + ``gather`` + the loss
  formula, in eager PyTorch. This is the baseline speed-ups are quoted against; the
  readable spec ``grpo_fast.reference`` (``reference``) is slower than it.
- ``trl``: TRL's path: ``logits / temperature``, then ``selective_log_softmax`` (imported
  from trl when installed; otherwise as TRL computes it: for float32 a gather and a
  per-sequence ``logsumexp`` loop, for bf16 a per-sequence ``log_softmax`` in bf16), then
  the same per-token loss.
- ``compiled``: ``torch.compile`` of ``plain``.
- ``liger``: Liger-Kernel's Triton GRPO loss (CUDA only; None when not importable).
- ``fused`` (and ``fused_inplace``): ``grpo_fast``.

The loss is GRPO's default: token-level ratios clipped at 0.2, k3 KL with beta = 0.04,
old and reference log-probs given, per-sequence mean of the masked tokens.
"""

import torch

import grpo_fast
from grpo_fast import reference

BETA, EPS = 0.04, 0.2
LOSS_IMPLS = ("plain", "fused", "fused_inplace", "trl", "compiled", "reference", "liger")
LOGPROB_IMPLS = ("plain", "fused", "trl", "compiled", "reference")


def make_batch(B: int, T: int, V: int, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict:
    """logits [B, T, V] (N(0, 2^2)), ids, per-sequence advantages of both signs, old and
    reference log-probs near the current ones (ratios on both sides of the clip range), mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    # Drawn in the target dtype, in place: no float32 [B, T, V] transient to inflate a peak measured later.
    logits = torch.randn(B, T, V, generator=g, device=device, dtype=dtype).mul_(2)
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    with torch.no_grad():  # the fused op, for the same reason
        logp = grpo_fast.token_logprobs(logits, ids)
    return dict(
        logits=logits,
        ids=ids,
        advantages=torch.randn(B, generator=g, device=device),
        mask=torch.ones(B, T, device=device),
        old=logp + 0.1 * torch.randn(B, T, generator=g, device=device),
        ref=logp + 0.3 * torch.randn(B, T, generator=g, device=device),
    )


def plain_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V], [B, T] -> [B, T] float32: the two lines everyone writes."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def trl_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """TRL's selective_log_softmax (TRL divides by the temperature first; here it is 1)."""
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        selective_log_softmax = _selective_log_softmax
    return selective_log_softmax(logits, ids)


def _selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # one sequence at a time
    rows = [torch.log_softmax(row, dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1) for row, i in zip(logits, ids)]
    return torch.stack(rows)


def plain_loss(logp, advantages, mask, old, ref):
    """The GRPO loss from per-token log-probs [B, T], written as plainly as it is read."""
    ratio = torch.exp(logp - old)
    adv = advantages.unsqueeze(1)
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv)
    d = ref - logp
    per_token = pg + BETA * (torch.exp(d) - d - 1)
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def _plain_step(logits, ids, advantages, mask, old, ref):
    return plain_loss(plain_logprobs(logits, ids), advantages, mask, old, ref)


def _trl_step(logits, ids, advantages, mask, old, ref):
    return plain_loss(trl_logprobs(logits, ids), advantages, mask, old, ref)


def liger_loss_fn():
    """Liger-Kernel's logits-level Triton GRPO loss, or None when it is not importable."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None
    return triton_grpo_loss


def loss_step(impl: str, batch: dict, **options):
    """A closure doing one loss forward + backward (gradient of the logits, as an LM head
    receives it: no ``.grad`` accumulation), or None when ``impl`` is unavailable here.
    ``options``: more ``grpo_loss`` keywords (e.g. ``importance_sampling="sequence"``), for
    grpo_fast's implementations only."""
    logits, args = batch["logits"], (batch["ids"], batch["advantages"], batch["mask"], batch["old"], batch["ref"])
    if options and impl not in ("fused", "fused_inplace", "reference"):
        raise ValueError(f"options {sorted(options)} are grpo_loss keywords: impl {impl!r} takes none")
    if impl in ("fused", "fused_inplace", "reference"):
        fn = reference.grpo_loss if impl == "reference" else grpo_fast.grpo_loss
        extra = dict(options, inplace_backward=True) if impl == "fused_inplace" else options

        def loss(x):
            return fn(x, *args, beta=BETA, eps_low=EPS, **extra).loss

    elif impl in ("plain", "trl", "compiled"):
        step = {"plain": _plain_step, "trl": _trl_step, "compiled": torch.compile(_plain_step)}[impl]

        def loss(x):
            return step(x, *args)

    elif impl == "liger":
        liger = liger_loss_fn()
        if liger is None or not logits.is_cuda:
            return None
        # Liger takes [B, T + 1, V] and drops the last position: pad one row, untimed.
        padded = torch.cat([logits, logits[:, -1:]], dim=1)

        def run():
            x = padded.detach().requires_grad_()
            out, _ = liger(
                x,
                batch["old"],
                batch["ref"],
                batch["ids"],
                batch["advantages"],
                batch["mask"],
                temperature=1.0,
                beta=BETA,
                eps_low=EPS,
                eps_high=EPS,
                inplace=True,
                loss_type="grpo",
                reduce=True,
            )
            torch.autograd.grad(out, x)

        return run
    else:
        raise ValueError(f"impl must be one of {LOSS_IMPLS}, got {impl!r}")

    def run():
        x = logits.detach().requires_grad_()
        torch.autograd.grad(loss(x), x)

    return run


def logprobs_step(impl: str, batch: dict):
    """A closure doing one no-grad log-prob pass (what the old and reference models need)."""
    fn = dict(
        fused=grpo_fast.token_logprobs,
        plain=plain_logprobs,
        trl=trl_logprobs,
        reference=reference.token_logprobs,
        compiled=torch.compile(plain_logprobs) if impl == "compiled" else None,
    )
    if impl not in fn:
        raise ValueError(f"impl must be one of {LOGPROB_IMPLS}, got {impl!r}")

    def run():
        with torch.no_grad():
            fn[impl](batch["logits"], batch["ids"])

    return run
