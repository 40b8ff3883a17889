"""A cost model of a GRPO step with generation on vLLM servers (issue 49): seconds a step, and
steps a second per GPU, for N training GPUs and M generation GPUs, on one node or several,
synchronous, one step ahead (``--max-staleness 1``), and with in-flight weight updates,
against the colocated engine on N + M GPUs. docs/engines.md, "What server mode costs", derives
it and gives its table.

A rollout's decoding is a sequence of decode steps. A step over c running sequences on one GPU
takes ``t0 + c t1``: t0 reads the weights and launches the step (it does not depend on c), t1
is a sequence's share (its KV cache read and its FLOPs). A batch rollout starts every sequence
at once and runs until its longest completion ends, the batch thinning as completions end: its
seconds are ``L_max t0 + (tokens / M) t1``. With in-flight updates (PipelineRL) a server never
drains: finished sequences are replaced by the next batch's, so it decodes at its full
concurrency c = n / M all the time, ``(tokens / M) (t0 / c + t1)``: the tail term ``L_max t0``
becomes ``L_mean t0``. Training is FLOPs over the N GPUs' rate (6 per parameter per token for
the policy's forward and backward, 2 for a reference forward, and a third more forward with
gradient checkpointing). A push is a fixed cost plus the weights' bytes over the link's
bandwidth (NVLink on one node, the network across nodes; or the TCP backend's measured rate).

    colocated     gen(N + M) + train(N + M) + reload          every GPU samples, then trains
    server, K=0   gen(M) + push + train(N)                    each side idles while the other works
    server, K=1   max(gen(M) + push, train(N))                the rollout worker pushes, then samples,
                                                              while the trainer trains
    in flight     max(gen_in_flight(M) + pause, train(N), push)  the servers never wait; a push must
                                                              not take longer than a step

    python benchmarks/server_cost_model.py            # the table for the Qwen2.5-1.5B recipe
    python benchmarks/server_cost_model.py --json benchmarks/results/server_cost_model.json
"""

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURED = os.path.join(HERE, "results", "server_overheads_cpu.json")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training step's work. Defaults: Qwen2.5-1.5B, 64 prompts x G = 8, prompts of 256
    tokens, completions of 400 on average and 1,024 at most, beta 0.04, gradient checkpointing."""

    parameters: float = 1.54e9
    weight_bytes: float = 3.09e9  # bf16
    prompts: int = 64
    group_size: int = 8
    prompt_tokens: int = 256
    mean_completion: float = 400.0
    max_completion: int = 1024
    reference: bool = True  # beta > 0: a reference forward
    checkpointing: bool = True

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    @property
    def completion_tokens(self) -> float:
        return self.sequences * self.mean_completion

    def training_flops(self) -> float:
        """FLOPs of the training passes: the policy's forward and backward (with a recompute's
        forward under checkpointing) and the reference's forward, over every forwarded token."""
        tokens = self.sequences * (self.prompt_tokens + self.mean_completion)
        per_token = 6 + (2 if self.checkpointing else 0) + (2 if self.reference else 0)
        return per_token * self.parameters * tokens


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a GPU and its links do. Defaults: an H100 SXM node (8 GPUs, NVLink) and 400 Gb/s
    between nodes; the decode step's t0 and t1 are assumptions for a 1.5B model under vLLM with
    CUDA graphs (docs/engines.md, "What server mode costs", derives them); push_fixed_s is this
    host's measurement when given (``measured_inputs``)."""

    peak_flops: float = 989e12  # bf16 dense
    mfu: float = 0.40  # the training passes' fraction of it
    decode_t0_s: float = 4e-3  # a decode step's weight read and launch
    decode_t1_s: float = 20e-6  # one running sequence's share of a decode step
    node_bytes_per_s: float = 150e9  # a weight push's rate inside a node (NCCL over NVLink)
    network_bytes_per_s: float = 40e9  # across nodes (NCCL over 400 Gb/s InfiniBand, about 80%)
    push_fixed_s: float = 0.05  # a push's handshake, version, prefix-cache reset
    reload_bytes_per_s: float = 1e12  # the colocated engine's in-memory reload (HBM to HBM)
    pause_s: float = 0.01  # in flight: a pause and resume around each push


def training_seconds(recipe: Recipe, hardware: Hardware, gpus: int) -> float:
    return recipe.training_flops() / (gpus * hardware.peak_flops * hardware.mfu)


def generation_seconds(recipe: Recipe, hardware: Hardware, gpus: int, in_flight: bool = False) -> float:
    """A rollout's decoding on ``gpus``: the batch's (its longest completion paces it), or in
    flight (the servers at full concurrency, the mean completion's pace)."""
    per_gpu = recipe.completion_tokens / gpus
    concurrency = recipe.sequences / gpus
    if in_flight:
        return per_gpu * (hardware.decode_t0_s / concurrency + hardware.decode_t1_s)
    return recipe.max_completion * hardware.decode_t0_s + per_gpu * hardware.decode_t1_s


def push_seconds(recipe: Recipe, hardware: Hardware, nodes: int, bytes_per_s: float | None = None) -> float:
    """A push of the weights to the servers: inside the node (nodes = 1) or across (nodes > 1);
    ``bytes_per_s`` overrides the link (the TCP backend's measured rate)."""
    rate = bytes_per_s or (hardware.node_bytes_per_s if nodes == 1 else hardware.network_bytes_per_s)
    return hardware.push_fixed_s + recipe.weight_bytes / rate


MODES = ("colocated", "server_sync", "server_async", "in_flight")


def step_seconds(
    recipe: Recipe, hardware: Hardware, train_gpus: int, gen_gpus: int, mode: str, nodes: int = 1, push_rate=None
) -> float:
    """Seconds of one step in ``mode`` (module docstring); colocated uses train_gpus + gen_gpus."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if train_gpus < 1 or gen_gpus < 1 or nodes < 1:
        raise ValueError(f"train_gpus, gen_gpus and nodes must be >= 1, got {train_gpus}, {gen_gpus}, {nodes}")
    if mode == "colocated":
        gpus = train_gpus + gen_gpus
        reload = recipe.weight_bytes / hardware.reload_bytes_per_s
        return generation_seconds(recipe, hardware, gpus) + training_seconds(recipe, hardware, gpus) + reload
    push = push_seconds(recipe, hardware, nodes, push_rate)
    train = training_seconds(recipe, hardware, train_gpus)
    if mode == "server_sync":
        return generation_seconds(recipe, hardware, gen_gpus) + push + train
    if mode == "server_async":
        return max(generation_seconds(recipe, hardware, gen_gpus) + push, train)
    return max(generation_seconds(recipe, hardware, gen_gpus, in_flight=True) + hardware.pause_s, train, push)


def measured_inputs(path: str = MEASURED) -> dict:
    """From ``bench_servers.py``'s JSON: the push's fixed cost (the tiny model's push), the TCP
    backend's rate (the slope of push seconds against bytes over the larger models) and a
    request's round trip; {} without the file."""
    if not os.path.isfile(path):
        return {}
    models = {m["model"]: m for m in json.load(open(path))["models"]}
    out = {}
    if "tiny" in models:
        out["push_fixed_s"] = models["tiny"]["push_s"]
        out["round_trip_s"] = models["tiny"]["round_trip_s"]
    sized = sorted((m for m in models.values() if m["model"] != "tiny"), key=lambda m: m["weight_bytes"])
    if len(sized) >= 2:
        a, b = sized[0], sized[-1]
        out["tcp_bytes_per_s"] = (b["weight_bytes"] - a["weight_bytes"]) / (b["push_s"] - a["push_s"])
    return out


def table(recipe: Recipe, hardware: Hardware, tcp_rate: float | None) -> list:
    """A row per layout of docs/engines.md ("What server mode costs"): each mode's seconds a step
    and its speed-up over the colocated engine on the same GPUs."""
    layouts = [(4, 4, 1), (6, 2, 1), (8, 8, 2), (12, 4, 2)]  # (training GPUs, generation GPUs, nodes)
    rows = []
    for train_gpus, gen_gpus, nodes in layouts:
        colocated = step_seconds(recipe, hardware, train_gpus, gen_gpus, "colocated")
        row = dict(layout=f"{train_gpus} train + {gen_gpus} gen, {nodes} node{'s' if nodes > 1 else ''}")
        row["colocated s"] = colocated
        for mode in MODES[1:]:
            seconds = step_seconds(recipe, hardware, train_gpus, gen_gpus, mode, nodes)
            row[f"{mode} s"] = seconds
            row[f"{mode} x"] = colocated / seconds
        if tcp_rate:
            seconds = step_seconds(recipe, hardware, train_gpus, gen_gpus, "in_flight", nodes, push_rate=tcp_rate)
            row["in_flight over TCP x"] = colocated / seconds
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default=MEASURED, help="bench_servers.py's JSON (its push and round trip)")
    parser.add_argument("--json", help="write the inputs and the table here")
    args = parser.parse_args(argv)
    measured = measured_inputs(args.measured)
    hardware = Hardware(**{k: v for k, v in measured.items() if k == "push_fixed_s"})
    recipe = Recipe()
    rows = table(recipe, hardware, measured.get("tcp_bytes_per_s"))
    from grpo_fast.bench.measure import print_table

    print_table(
        [{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows], list(rows[0])
    )
    if args.json:
        with open(args.json, "w") as f:
            inputs = dict(recipe=dataclasses.asdict(recipe), hardware=dataclasses.asdict(hardware), measured=measured)
            json.dump(dict(inputs=inputs, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
