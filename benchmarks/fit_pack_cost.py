"""Fits the packed forward's cost model (``grpo_fast.packing.cost.HostCost``) on this host.

A pack's layer costs its dense FLOPs, its SDPA calls (a fixed cost each plus their query x key
pairs, causal or masked) and the gathers into and out of the calls' grids. This script times
each of those alone, one torch thread, at the shapes the trainer's packs have (widths 256 to
896, grids of 1 to 32 rows of 16 to 512 tokens), and fits seconds per unit by least squares:

    flop     matmuls [S, h] @ [h, k]: seconds per FLOP
    call, row, causal, masked
             SDPA calls, one fit over both kinds: a call's fixed cost, a grid row's (per head
             channel), and seconds per query-key pair x channel of a causal call ([r, H, R, d],
             is_causal: r R^2 H d up to the kernel's key block, cost.attended_pairs) and of a
             masked one (keys [r, H, P + R, d]: r R (P + R) H d)
    gather   index_select of [H, S, d] rows: seconds per element

The fitted numbers go into ``HOST_COSTS`` by hand (with the host and date in benchmarks/NOTES.md),
so that every run packs alike: a model timed at start-up would make two runs of one seed pick
different layouts, whose float32 results differ.

    python benchmarks/fit_pack_cost.py                         # results/pack_cost_cpu.json
    python benchmarks/fit_pack_cost.py --repeats 3 --output /tmp/pack_cost.json   # smoke test
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, time_fn  # noqa: E402

from grpo_fast.packing.cost import HOST_COSTS, HostCost, attended_pairs  # noqa: E402

_sdpa = torch.nn.functional.scaled_dot_product_attention
BLOCK = HOST_COSTS["cpu"].block  # the CPU kernel's key split: not fitted


def _fit(points: list) -> list:
    """Seconds per term: the least-squares fit of ``points`` [(terms, seconds)], ``terms`` the
    counts each term's cost multiplies (1 for a fixed cost), weighted by 1 / seconds so that
    small calls count as much as large ones."""
    terms = torch.tensor([t for t, _ in points], dtype=torch.float64)
    seconds = torch.tensor([s for _, s in points], dtype=torch.float64)
    weight = 1 / seconds
    fit = torch.linalg.lstsq(terms * weight[:, None], (seconds * weight)[:, None]).solution[:, 0]
    return fit.tolist()


def _median(fn, repeats: int) -> float:
    return time_fn(fn, warmup=2, repeats=repeats)["median_s"]


def dense(repeats: int) -> list:
    """[(FLOPs, seconds)] of the dense layers' matmuls at the trainer's widths."""
    points = []
    for h, k in ((256, 768), (576, 1536), (896, 4864)):
        for S in (256, 1024, 2048):
            a, w = torch.randn(S, h), torch.randn(h, k)
            points.append(([2 * S * h * k], _median(lambda: a @ w, repeats)))
    return points


def attention(repeats: int) -> list:
    """[([1, rows x channels, causal pairs x channels, masked pairs x channels], seconds)] of
    SDPA calls on grids of 1 to 32 rows: causal, or after a prefix of the rows' length with a
    mask."""
    points = []
    for heads, d in ((4, 64), (9, 64), (14, 64)):
        for rows, R in ((1, 16), (1, 128), (1, 512), (8, 32), (8, 128), (32, 16), (32, 64)):
            for masked in (False, True):
                P = R if masked else 0
                q = torch.randn(rows, heads, R, d)
                k, v = torch.randn(rows, heads, P + R, d), torch.randn(rows, heads, P + R, d)
                mask = torch.ones(R, P + R, dtype=torch.bool).tril(P)[None, None].expand(rows, 1, R, P + R)
                if masked:
                    call = lambda: _sdpa(q, k, v, attn_mask=mask)  # noqa: E731
                else:
                    call = lambda: _sdpa(q, k, v, is_causal=True)  # noqa: E731
                pairs = rows * attended_pairs(R, P + R, masked, BLOCK) * heads * d
                units = [1, rows * heads * d, 0 if masked else pairs, pairs if masked else 0]
                points.append((units, _median(call, repeats)))
    return points


def gather(repeats: int) -> list:
    """[([elements], seconds)] of the grids' gathers: index_select of [H, S, d] along S."""
    points = []
    for heads, S, M in ((4, 1024, 1024), (4, 2048, 4096), (14, 1024, 2048), (14, 4096, 8192)):
        x, reads = torch.randn(heads, S, 64), torch.randint(0, S, (M,))
        points.append(([heads * M * 64], _median(lambda: x.index_select(1, reads), repeats)))
    return points


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "pack_cost_cpu.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be a positive int, got {args.repeats}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    measured = {"dense": dense(args.repeats), "attention": attention(args.repeats), "gather": gather(args.repeats)}
    fits = {name: _fit(points) for name, points in measured.items()}
    (flop,), (call, row, causal, masked), (gather_s,) = fits["dense"], fits["attention"], fits["gather"]
    fitted = HostCost(flop=flop, call=call, row=row, causal=causal, masked=masked, gather=gather_s, block=BLOCK)
    print(f"fitted {fitted}")
    print(f"in use {HOST_COSTS['cpu']}")
    for name, points in measured.items():
        predicted = [sum(c * u for c, u in zip(fits[name], units)) for units, _ in points]
        errors = sorted(abs(p - s) / s for p, (_, s) in zip(predicted, points))
        print(f"{name:9s} relative error: median {errors[len(errors) // 2]:.2f}, worst {errors[-1]:.2f}")
    with open(args.output, "w") as f:
        json.dump(dict(machine=machine_info(), fitted=fitted._asdict(), fits=fits, measured=measured), f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
