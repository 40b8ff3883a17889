"""CPU benchmark of the fused LM-head GRPO loss: fwd+bwd time and peak memory, side by side.

Implementations, on the same batch (hidden [N, H], an LM head [V, H], float32):

    plain       logits = hidden @ weight.T, then float32 log_softmax + gather + the loss formula
                (baselines.py's plain recipe): the baseline every ratio is against
    compiled    torch.compile of plain
    eager       logits = hidden @ weight.T, then reference.grpo_loss (the spec, materialised)
    fused       grpo_fast.fused_linear_grpo_loss
    liger       Liger-Kernel's LigerFusedLinearGRPOLoss (chunked torch; compiled=False), if installed
    liger_compiled  the same with torch.compile (Liger's default), with --liger-compiled

Each implementation runs in a fresh subprocess: a warm-up forward + backward (which compiles
what compiles), then timed repeats, median (20%, 80%); the first of them also reports the
growth of the peak RSS during the call (the high-water mark reset before it, so the warm-up's
compile does not count). Gradients are taken for hidden and weight with torch.autograd.grad, as a
training step would. Every implementation's loss is printed beside the others' as a check
that they compute the same thing.

    python benchmarks/bench_fused_linear.py            # N=4096, H=1024, V=151936: writes results/fused_linear_cpu.json
    python benchmarks/bench_fused_linear.py --quick    # tiny shapes (smoke test, no JSON)
"""

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, peak_rss_growth, print_table, quantiles, run_isolated  # noqa: E402

SEQ_LEN = 1024  # tokens per sequence; B = N / SEQ_LEN sequences (one Liger chunk each)
LOSS = dict(beta=0.04, eps_low=0.2, eps_high=0.2, loss_type="grpo")


def make_batch(N: int, H: int, V: int, dtype, device="cpu", seq_len: int = SEQ_LEN):
    """A GRPO batch at an LM head: unit-scale logits, old/reference log-probs near the
    policy's (ratios within a few percent, some clipped), both signs of A, 10% padding."""
    import torch

    import grpo_fast

    torch.manual_seed(0)
    B, T = max(1, N // seq_len), min(N, seq_len)
    hidden = torch.randn(B, T, H, device=device, dtype=dtype)
    weight = (torch.randn(V, H, device=device, dtype=dtype) / H**0.5).requires_grad_()
    ids = torch.randint(0, V, (B, T), device=device)
    with torch.no_grad():  # old and ref are data: no graph back to the weight
        logp = grpo_fast.fused_linear_token_logprobs(hidden, weight, ids)
    old = logp + 0.1 * torch.randn(B, T, device=device)
    ref = logp + 0.3 * torch.randn(B, T, device=device)
    mask = torch.ones(B, T, device=device)
    mask[:, int(T * 0.9) :] = 0
    adv = torch.randn(B, device=device)
    return dict(hidden=hidden.requires_grad_(), weight=weight, ids=ids, mask=mask, advantages=adv, old=old, ref=ref)


def forward_fn(impl: str, batch):
    """A function of no arguments that runs one forward of ``impl`` and returns the loss (a scalar
    with a graph back to ``batch["hidden"]`` and ``batch["weight"]``)."""
    import grpo_fast
    from grpo_fast import reference

    h, w, ids, mask, adv, old, ref = (batch[k] for k in ("hidden", "weight", "ids", "mask", "advantages", "old", "ref"))
    if impl == "eager":

        def forward():
            return reference.grpo_loss(h @ w.T, ids, adv, mask, old, ref, **LOSS).loss

    elif impl in ("plain", "compiled"):
        import torch
        from baselines import plain_logprobs, plain_loss  # its BETA and EPS are LOSS's

        def plain(h, w):
            return plain_loss(plain_logprobs(h @ w.T, ids), adv, mask, old, ref)

        run = torch.compile(plain) if impl == "compiled" else plain

        def forward():
            return run(h, w)

    elif impl == "fused":

        def forward():
            return grpo_fast.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, **LOSS).loss

    elif impl.startswith("liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=LOSS["beta"],
            epsilon_low=LOSS["eps_low"],
            epsilon_high=LOSS["eps_high"],
            loss_type=LOSS["loss_type"],
            compiled=impl == "liger_compiled",
            chunk_size=1,
        )

        def forward():
            return liger(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]

    else:
        raise ValueError(f"unknown implementation {impl!r}")
    return forward


def loss_fn(impl: str, batch):
    """A function of no arguments that runs one forward + backward of ``impl`` and returns the loss."""
    import torch

    forward = forward_fn(impl, batch)

    def step():
        loss = forward()
        torch.autograd.grad(loss, (batch["hidden"], batch["weight"]))
        return loss.item()

    return step


def worker(config: dict) -> dict:
    import torch

    if config["threads"]:
        torch.set_num_threads(config["threads"])
    batch = make_batch(config["N"], config["H"], config["V"], getattr(torch, config["dtype"]))
    step = loss_fn(config["impl"], batch)
    loss = step()  # the warm-up: compiles what compiles
    samples = []

    def timed():
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)

    peak = peak_rss_growth(timed, reset=True)
    for _ in range(config["repeats"] - 1):
        timed()
    return {"peak_bytes": peak, "loss": loss, **quantiles(samples)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0: torch's default). On a shared machine "
        "1 avoids the OpenMP barrier waiting a scheduler slice for a descheduled thread at every parallel op",
    )
    parser.add_argument("--liger-compiled", action="store_true", help="also time Liger with torch.compile")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (smoke test, no JSON)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "fused_linear_cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    N, H, V, repeats = (256, 64, 4096, 1) if args.quick else (args.tokens, args.hidden, args.vocab, args.repeats)
    impls = ["plain", "compiled", "eager", "fused"]
    if importlib.util.find_spec("liger_kernel") is not None:
        impls += ["liger"] + (["liger_compiled"] if args.liger_compiled else [])
    results = {}
    for impl in impls:
        config = dict(impl=impl, N=N, H=H, V=V, dtype="float32", repeats=repeats, threads=args.threads)
        results[impl] = {**config, **run_isolated(__file__, config, timeout=3600)}
        print(f"{impl}: {results[impl]}", file=sys.stderr)

    plain, rows = results["plain"], []
    flops = 6 * N * H * V  # three [N, H] x [H, V]-sized matmuls: forward, grad hidden, grad weight
    for impl, res in results.items():
        if "error" in res:
            rows.append({"impl": impl, "time s": "error: " + res["error"]})
            continue
        row = {
            "impl": impl,
            "loss": f"{res['loss']:.6f}",
            "time s": f"{res['median_s']:.2f} ({res['p20_s']:.2f}-{res['p80_s']:.2f})",
            "GFLOP/s (6NHV)": f"{flops / res['median_s'] / 1e9:.0f}",
            "peak MB": f"{res['peak_bytes'] / 2**20:.0f}",
        }
        if "error" not in plain:
            row["time / plain"] = f"{res['median_s'] / plain['median_s']:.2f}"
            row["peak / plain"] = f"{res['peak_bytes'] / plain['peak_bytes']:.3f}"
        rows.append(row)
    threads = args.threads or "default"
    print(f"N={N} tokens, H={H}, V={V}, float32, {threads} threads, loss {LOSS}; fwd+bwd (grads of hidden and weight)")
    print_table(rows, ["impl", "time s", "time / plain", "GFLOP/s (6NHV)", "peak MB", "peak / plain", "loss"])
    if not args.quick:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine_info(),
                    "load_average": os.getloadavg(),
                    "loss": LOSS,
                    "results": list(results.values()),
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
