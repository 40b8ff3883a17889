"""Where a completion token's bytes go in a training step (issue 50, item 2), measured.

Three measurements; each point runs in a fresh process (one thread, the mmap threshold of
``grpo-fast bench memory``) and reports its peak RSS growth, as ``bench_long_context`` does:

    layers    the step of ``bench_long_context`` (G = 4, a prompt of 256 tokens) on SmolLM2's
              shape (H 576, MLP 1536, 9/3 heads of 64, V 49,152) built with ``--layer-counts``
              decoder layers, at each of ``--lengths``. The marginal bytes per completion token
              at k layers are ``once + k x per_layer``: two layer counts split them into what
              each layer holds per token and what the step holds once per token (the layer
              recomputed in the backward, the head, the loss).
    trl-head  TRL 1.16's ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py) alone on
              N tokens (hidden [N, H], SmolLM2's head [V, H]; log-probs and entropy, as
              ``GRPOTrainer`` asks; the backward from the log-probs): its peak over its inputs.
              Its tiles are ``min(N, TOKEN_CHUNK_SIZE = 4096)`` tokens x 32,768 vocabulary
              entries, folded by a Triton kernel on CUDA and by ``_forward_tile`` /
              ``_backward_tile`` in torch elsewhere, whose float32 temporaries are each a tile.
    trl-step  ``bench_long_context``'s TRL step on SmolLM2 at each of ``--lengths`` with TRL's
              ``TOKEN_CHUNK_SIZE`` set to ``--token-chunk``: the step's peak with a smaller tile.
    attention one layer's attention as our packed attention calls it on a group's completions
              (``packing.attention.packed_sdpa``: a grid of G rows, L queries against P + L keys,
              a boolean key mask [G, 1, L, P + L], SmolLM2's 9 query and 3 key-value heads
              taken as they are), forward and backward, at each of ``--lengths``: the working
              set of the layer recomputed in the backward, and SDPA's float copy of the mask.
              ``--mask lower-right`` gives the same attention (one prompt length a grid) as
              torch's ``causal_lower_right`` bias instead of a boolean tensor; ``--mask
              replayed`` as ``packing.grids`` runs it where its cost model says so: causal rows
              of [prompt | completion], P + L queries, no mask. Also the call's seconds.

    python benchmarks/long_context_accounting.py layers --layer-counts 2 8 --lengths 1024 2048
    python benchmarks/long_context_accounting.py trl-head --tokens 1024 2048 4096 8192
    python benchmarks/long_context_accounting.py trl-step --lengths 512 1024 --token-chunk 1024
    python benchmarks/long_context_accounting.py attention --lengths 1024 2048 4096
    python benchmarks/long_context_accounting.py attention --lengths 1024 2048 4096 --mask lower-right
"""

import argparse
import json
import os
import sys
import time

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
PROMPT, GROUP = 256, 4  # bench_long_context's defaults
TRL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_long_context.py")  # its TRL worker


def head_worker(spec: dict) -> dict:
    """Peak RSS growth of TRL's chunked head on ``spec["tokens"]`` tokens over its inputs."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from grpo_fast.bench.measure import rss_rise_from_here

    torch.manual_seed(0)
    N, H, V = spec["tokens"], SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) * H**-0.5).requires_grad_()
    targets = torch.randint(V, (N,))
    risen = rss_rise_from_here()
    logprobs, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "entropy")
    )
    forward_peak = risen()
    logprobs.sum().backward()  # GRPOTrainer logs the entropy: no gradient flows from it
    return dict(tokens=N, forward_peak_bytes=forward_peak, peak_bytes=risen())


def attention_worker(spec: dict) -> dict:
    """Peak RSS growth of one masked SDPA call on a completion grid over its inputs (docstring)."""
    import torch

    from grpo_fast.bench.measure import rss_rise_from_here

    torch.manual_seed(0)
    L, P, G, d = spec["completion_length"], PROMPT, GROUP, 64
    heads, kv_heads = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"]
    queries = P + L if spec["mask"] == "replayed" else L  # replayed: the prompt's queries too, causal
    q = torch.randn(G, heads, queries, d, requires_grad=True)
    k, v = (torch.randn(G, kv_heads, P + L, d, requires_grad=True) for _ in range(2))
    if spec["mask"] == "lower-right":  # query i sees keys up to P + i: its prompt, then causal
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(L, P + L)
    elif spec["mask"] == "bool":
        mask = torch.ones(L, P + L, dtype=torch.bool).tril(P).expand(G, 1, L, P + L).contiguous()
    else:
        mask = None
    grad = torch.randn(G, heads, queries, d)
    risen = rss_rise_from_here()
    start = time.perf_counter()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    forward_peak = risen()
    out.backward(grad)
    seconds = time.perf_counter() - start
    return dict(
        forward_peak_bytes=forward_peak,
        peak_bytes=risen(),
        seconds=seconds,
        mask_elements=G * L * (P + L),
        mask=spec["mask"],
        output_bytes=out.numel() * out.element_size(),
    )


def trl_step_worker(spec: dict) -> dict:
    """``bench_long_context.trl_worker`` with TRL's token tile set to ``spec["token_chunk"]``."""
    import trl.kernels.chunked_logprob as chunked
    from bench_long_context import trl_worker

    chunked.TOKEN_CHUNK_SIZE = spec["token_chunk"]  # read at each call of the function
    return dict(trl_worker(spec), token_chunk=spec["token_chunk"])


WORKERS = {"attention": attention_worker, "trl-head": head_worker, "trl-step": trl_step_worker}


def specs(args: argparse.Namespace) -> list:
    """(argv, worker spec) of each point."""
    from bench_long_context import point_spec

    this = [sys.executable, __file__, args.mode]
    if args.mode == "trl-head":
        return [(this, dict(tokens=n)) for n in args.tokens]
    if args.mode == "attention":
        return [(this, dict(completion_length=n, mask=args.mask)) for n in args.lengths]
    if args.mode == "trl-step":
        return [
            (this, dict(point_spec("smollm2", n, True, PROMPT, GROUP), token_chunk=args.token_chunk))
            for n in args.lengths
        ]
    out = []
    for trainer in args.trainers:
        argv = [sys.executable, "-m", "grpo_fast.bench.memory"] if trainer == "grpo_fast" else [sys.executable, TRL]
        for k in args.layer_counts:
            for n in args.lengths:
                spec = point_spec("tiny", n, args.checkpointing == "on", PROMPT, GROUP)
                spec.update(model=dict(SMOLLM2, num_hidden_layers=k), preset=f"smollm2-shape-{k}-layers")
                out.append((argv, dict(spec, trainer=trainer, layers=k)))
    return out


def per_layer_split(points: list) -> list:
    """Per trainer: the marginal bytes per completion token between consecutive lengths at each
    layer count, and from two layer counts their split into per layer and once (module docstring)."""
    rows = []
    for trainer in sorted({p["trainer"] for p in points}):
        slopes = {}
        for k in sorted({p["layers"] for p in points if p["trainer"] == trainer}):
            ran = sorted(
                (p for p in points if (p["trainer"], p["layers"]) == (trainer, k) and "peak_bytes" in p),
                key=lambda p: p["length"],
            )
            if len(ran) >= 2:
                a, b = ran[0], ran[-1]
                slopes[k] = (b["peak_bytes"] - a["peak_bytes"]) / (GROUP * (b["length"] - a["length"]))
        row = dict(trainer=trainer, bytes_per_token_at_layers=slopes)
        if len(slopes) >= 2:
            (k0, s0), (k1, s1) = min(slopes.items()), max(slopes.items())
            row["per_layer_bytes_per_token"] = (s1 - s0) / (k1 - k0)
            row["once_bytes_per_token"] = s0 - k0 * row["per_layer_bytes_per_token"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["layers", "trl-head", "trl-step", "attention"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="layers, trl-step: L")
    parser.add_argument("--layer-counts", nargs="+", type=int, default=[2, 8], help="layers: decoder layers")
    parser.add_argument("--trainers", nargs="+", default=["grpo_fast"], help="layers: grpo_fast and/or trl")
    parser.add_argument("--checkpointing", default="on", help="layers: on or off")
    parser.add_argument(
        "--mask", choices=["bool", "lower-right", "replayed"], default="bool", help="attention: the mask"
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048, 4096, 8192], help="trl-head: N")
    parser.add_argument("--token-chunk", type=int, default=1024, help="trl-step: TRL's TOKEN_CHUNK_SIZE (4096 shipped)")
    parser.add_argument("--json", help="where to write the points")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.mode](json.loads(args.worker))))
        return 0
    for name in ("lengths", "layer_counts", "tokens"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must be ints >= 1, got {getattr(args, name)}")
    if args.token_chunk < 1:
        parser.error(f"--token-chunk must be >= 1, got {args.token_chunk}")
    if args.checkpointing not in ("on", "off"):
        parser.error(f"--checkpointing must be on or off, got {args.checkpointing}")
    if [t for t in args.trainers if t not in ("grpo_fast", "trl")]:
        parser.error(f"--trainers must be of grpo_fast, trl, got {args.trainers}")

    from grpo_fast.bench.measure import machine_info, run_isolated
    from grpo_fast.bench.memory import MALLOC_ENV

    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    points = []
    for command, spec in specs(args):
        point = run_isolated(command, spec, timeout=3600, env=env)
        point.update({k: spec[k] for k in ("trainer", "layers") if k in spec})
        if "completion_length" in spec:
            point["length"] = spec["completion_length"]
        points.append(point)
        shown = {k: point.get(k) for k in ("trainer", "layers", "length", "tokens", "peak_bytes", "step_s", "error")}
        print(json.dumps(shown), flush=True)
    results = dict(mode=args.mode, points=points, machine=machine_info(), command=" ".join(sys.argv))
    if args.mode == "layers":
        results["split"] = per_layer_split(points)
        print(json.dumps(results["split"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
