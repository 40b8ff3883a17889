"""The vLLM engine in server mode (``--vllm-mode server``) against two vLLM CPU servers on
127.0.0.1, started by ``grpo-fast serve`` once for the module (about 70-100 s on 2 cores, most
of the module's time) and stopped after it: training on both (one process, a rollout worker
ahead, 2 torchrun ranks, resumed), weight pushes through the ``grpo_fast_tcp`` backend (the
trainer's log-probs after each), samples equal to the colocated engine's, and the faults: a
server of another model, a push broken mid-stream, a version that does not move, a stalled
server, a dead one (last: it kills both).

Needs vLLM's CPU build (the README's test command installs it).
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch
from conftest import ROOT, child_env, completion_logprobs, run_child, small_config, torchrun_command

from grpo_fast.tasks.arithmetic import build_dataset, build_model, build_tokenizer
from grpo_fast.trainer import GRPOConfig, GRPOTrainer
from grpo_fast.trainer.run.run_log import read_metrics

pytest.importorskip("vllm", reason="vLLM is not installed (see the README's test command)")

from grpo_fast.trainer.rollout.engines import EngineSettings, make_generator  # noqa: E402
from grpo_fast.trainer.rollout.engines.vllm_server import ServerError, serve_command  # noqa: E402

pytestmark = pytest.mark.slow  # the module's servers take about a minute to start

HEADS = dict(num_attention_heads=2, num_key_value_heads=2)  # head_dim 32: vLLM's CPU attention takes it
PROMPTS = [row["prompt"] for row in build_dataset(6, seed=1)]  # 4 tokens each
# float32 servers and trainer, the same weights: max |server log-prob - trainer log-prob| over a
# completion. Measured on one server, 64 samples of 6 tokens a version: 2.4e-7 at the initial
# weights, then 3e-6 to 3.7e-5 after each of five pushes of perturbed weights (mean 1e-6): the
# kernels differ, the weights arrive bit for bit
BOUND = 1e-4
# each server: vLLM's flags for a model of 32 positions, a KV cache of one rollout, no compile
SERVER_FLAGS = "--host 127.0.0.1 --max-model-len 32 --kv-cache-memory-bytes 16000000 --enforce-eager".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(server: subprocess.Popen, signum=signal.SIGTERM) -> None:
    """Stops a server and its engine core (its process group); SIGKILL after 20 s."""
    if server.poll() is None:
        os.killpg(server.pid, signum)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The policy's starting weights and tokenizer, saved: what the servers start from."""
    folder = tmp_path_factory.mktemp("served")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, **HEADS).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """``{url: Popen}`` of two servers of ``model_dir``, started together, each in its own
    process group (its engine core stops with it); stopped at the module's end."""
    logs = tmp_path_factory.mktemp("server_logs")
    env = child_env(VLLM_CPU_OMP_THREADS_BIND="nobind")  # two servers, one thread each, unpinned
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env["PYTHONPATH"]])  # the servers import this checkout
    started = {}
    for port in (free_port(), free_port()):
        command = [sys.executable, "-m", "grpo_fast", "serve", model_dir, "--port", str(port), *SERVER_FLAGS]
        with open(logs / f"{port}.log", "w") as log:
            started[f"http://127.0.0.1:{port}"] = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
    try:
        deadline = time.monotonic() + 400
        for url, server in started.items():
            while not healthy(url):
                assert server.poll() is None, (logs / f"{url.rsplit(':', 1)[1]}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{url} did not start"
                time.sleep(1)
        yield started
    finally:
        for server in started.values():
            stop(server)


def healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=5).ok
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def engine(servers, model_dir):
    """The server engine for a policy loaded from ``model_dir``, on both servers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(generator="vllm", vllm_mode="server", vllm_server_urls=list(servers), max_new_tokens=6)
    return make_generator("vllm", model, AutoTokenizer.from_pretrained(model_dir), EngineSettings.of(config))


def server_logprobs(engine, url: str, ids: list, completion: int) -> torch.Tensor:
    """[completion] the server's log-probs of the last ``completion`` tokens of ``ids`` (its
    prompt log-probs at temperature 1)."""
    body = dict(model=engine.servers[0].model, prompt=ids, max_tokens=1, echo=True, logprobs=0, temperature=1.0)
    answer = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    return torch.tensor(answer["choices"][0]["logprobs"]["token_logprobs"][len(ids) - completion : len(ids)])


def fixed_completion_gap(engine, url: str) -> float:
    """max |server log-prob - policy log-prob| over a fixed completion of a fixed prompt."""
    ids = engine.tokenizer(PROMPTS[0] + "7" + "12", add_special_tokens=False)["input_ids"]
    ids += [engine.tokenizer.eos_token_id]
    C = 4
    with torch.no_grad():
        policy = completion_logprobs(engine.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), C)
    return (server_logprobs(engine, url, ids, C) - policy[0]).abs().max().item()


def server_version(url: str) -> str:
    return requests.get(url + "/weight_info", timeout=10).json()["weight_version"]


def perturb(model) -> None:
    """An optimizer step's worth of change to every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)


def test_serve_adds_what_training_needs_and_the_users_flags_win():
    """grpo-fast serve's command: the backend, log-prob mode and model, then the user's flags,
    each flag once (one the user gives is not added)."""
    command = serve_command("some/model", ["--dtype", "bfloat16", "--port", "9000"])
    assert command[command.index("--model") + 1] == "some/model"
    assert '{"backend": "grpo_fast_tcp"}' in command and "processed_logprobs" in command
    assert command.count("--dtype") == 1 and command[-4:] == ["--dtype", "bfloat16", "--port", "9000"]


def test_a_server_of_another_model_is_refused_naming_it(servers):
    """A policy whose weights differ in shape from the served model's is refused at connect,
    with the server, the served model and each differing field named."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, num_hidden_layers=3, **HEADS)
    url = next(iter(servers))
    config = GRPOConfig(generator="vllm", vllm_mode="server", vllm_server_urls=[url])
    with pytest.raises(
        ValueError, match=rf"vLLM server {url} serves another model .*num_hidden_layers: policy 3, server 2"
    ):
        make_generator("vllm", model, tokenizer, EngineSettings.of(config))


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["synchronous", "worker_one_step_ahead"])
def test_two_steps_train_on_two_servers(servers, model_dir, tmp_path, max_staleness):
    """A 2-step run pushes each step's weights to both servers and trains on their samples,
    corrected for their log-probs, and resumed pushes the restored weights before its first
    rollout; with max_staleness 1 the rollout worker's engine pushes the weights it loaded, and a
    batch is at most one step old."""
    config = small_config(
        tmp_path,
        model=model_dir,
        steps=2,
        generator="vllm",
        vllm_mode="server",
        vllm_server_urls=list(servers),
        max_staleness=max_staleness,
    )
    trainer = GRPOTrainer(config)
    trainer.train()
    rows = read_metrics(config.output_dir)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["vllm_servers_up"] == 2 for row in rows) and rows[0]["sync_time_s"] > 0
    assert all("sampling/importance_sampling_ratio/mean" in row for row in rows)
    assert all(row["staleness"] <= max_staleness for row in rows) if max_staleness else "staleness" not in rows[0]
    # the synchronous run pushed the weights of both steps; the worker those it sampled with last
    # (it samples ahead, batches the run may not ask for, with any weights it was given up to step 2)
    held = {server_version(url) for url in servers}
    assert held == {"2"} if not max_staleness else held <= {"0", "1", "2"}
    if max_staleness:
        return
    # resumed, the run pushes its restored weights before its first rollout: the servers first
    # get other weights (the starting ones, from an engine of their own)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    make_generator("vllm", start, trainer.tokenizer, EngineSettings.of(config)).generate(PROMPTS[:1], 2, [0])
    assert {server_version(url) for url in servers} == {"0"}
    config.steps = 3
    resumed = GRPOTrainer(config)
    assert resumed.resume() == 2 and {server_version(url) for url in servers} == {"2"}
    assert all(fixed_completion_gap(resumed.source.engine, url) < BOUND for url in servers)
    resumed.train()
    assert {server_version(url) for url in servers} == {"3"}


def test_torchrun_two_ranks_train_on_two_servers(servers, model_dir, tmp_path):
    """``grpo-fast train`` under torchrun (2 processes, DDP): each rank samples its share of the
    prompts on the servers, rank 0 pushes each step's weights for both; the servers' log-probs
    are the trainer's over both ranks' samples."""
    out = tmp_path / "run"
    command = torchrun_command(
        "-m", "grpo_fast", "train", "--model", model_dir, "--generator", "vllm", "--vllm-mode", "server",
        "--vllm-server-urls", *servers, "--steps", "2", "--batch-size", "16", "-G", "4", "--max-new-tokens", "3",
        "--save-every", "0", "--no-progress", "--output-dir", str(out),
    )  # fmt: skip
    result = run_child(command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    history = read_metrics(str(out))
    assert [m["step"] for m in history] == [1, 2]
    assert all(m["sampling/sampling_logp_difference/max"] < BOUND for m in history)
    assert {server_version(url) for url in servers} == {"2"}


def test_each_push_brings_every_server_to_the_policys_log_probs(engine, servers):
    """After each push, both servers report the version and give the policy's log-probs of a
    fixed completion to BOUND (float32); a rollout's samples carry the policy's log-probs and
    their version per token, its groups spread over both servers, each group on one."""
    taken = []
    request = engine._request

    def recording(server, verb, path, body=None, timeout=None):
        if path == "/v1/completions":
            taken.append(server.url)
        return request(server, verb, path, body, timeout)

    engine._request = recording
    try:
        for version in (1, 2):
            perturb(engine.model)
            engine.publish(version)
            for url in servers:
                assert server_version(url) == str(version)
                assert fixed_completion_gap(engine, url) < BOUND
            taken.clear()
            out = engine.generate(PROMPTS, 4, list(range(6)))
            policy = completion_logprobs(engine.model, out.input_ids, out.attention_mask, out.completion_mask.shape[1])
            assert ((policy - out.logprobs) * out.completion_mask).abs().max() < BOUND
            assert bool((out.versions[out.completion_mask.bool()] == version).all())
            assert bool((out.versions[~out.completion_mask.bool()] == -1).all())
            assert len(taken) == len(PROMPTS) and set(taken) == set(servers)  # one request a group, both used
    finally:
        engine._request = request
    assert engine.metrics()["sync_time_s"] > 0


def test_a_push_broken_mid_stream_leaves_the_server_on_its_old_version(engine, servers):
    """The trainer's stream to one server breaks after two tensors: that server keeps its old
    weights and version (vLLM's worker loads only a whole update), the trainer knows it, no
    rollout samples from it; the next sync pushes it again."""
    first, second = engine.servers
    old = engine.published
    engine.publish(old)  # both current
    intact = first.transfer.source

    class Broken:
        def metadata(self):
            return intact.metadata()

        def __iter__(self):
            for i, item in enumerate(intact):
                if i == 2:
                    raise ConnectionResetError("the trainer's link broke")
                yield item

    perturb(engine.model)
    first.transfer.source = Broken()
    try:
        engine.publish(old + 1)
    finally:
        first.transfer.source = intact
    assert first.version == old and "ConnectionResetError" in first.error and not first.down
    assert server_version(first.url) == str(old) and server_version(second.url) == str(old + 1)
    assert fixed_completion_gap(engine, second.url) < BOUND
    assert fixed_completion_gap(engine, first.url) > 1e-2  # the old weights, whole
    assert engine._ready() == [second]
    engine.sync()
    assert first.version == old + 1 and first.error is None and fixed_completion_gap(engine, first.url) < BOUND


def test_a_server_that_reports_an_old_version_after_a_push_is_refused(engine, servers):
    """A server whose version does not move with a push (its finish did not take) is not
    sampled from, with the versions named; the next push that takes brings it back."""
    first, second = engine.servers
    finish = first.transfer.client.finish_weight_update
    first.transfer.client.finish_weight_update = lambda weight_version=None: finish(None)
    try:
        engine.publish(engine.published + 1)
    finally:
        first.transfer.client.finish_weight_update = finish
    new = engine.published
    assert first.error == f"reports version {new - 1} after the push of version {new}" and first.version == new - 1
    assert engine._ready() == [second]
    engine.sync()
    assert first.version == new and first.error is None and server_version(first.url) == str(new)


def test_the_server_benchmarks_measurements_run_on_the_servers(engine, servers):
    """benchmarks/bench_servers.py's measurements, the cost model's measured inputs, on the
    module's servers: timed pushes that move every server's version, one-token round trips, and
    a rollout's tokens a second."""
    sys.path.append(os.path.join(ROOT, "benchmarks"))  # after tests/: its conftest is not ours
    import bench_servers

    pushes = bench_servers.push_seconds(engine, 2)
    assert len(pushes) == 2 and min(pushes) > 0
    assert {server_version(url) for url in servers} == {str(engine.published)}
    trips = bench_servers.round_trip_seconds(next(iter(servers)), engine.servers[0].model, 2)
    assert len(trips) == 2 and min(trips) > 0
    rate = bench_servers.rollout_rate(engine, PROMPTS[:2], 4, 1)
    assert (
        0 < rate["completion_tokens"] <= 2 * 4 * 6
        and rate["tokens_per_s"] == rate["completion_tokens"] / rate["seconds"]
    )


def test_a_server_samples_what_the_colocated_engine_samples(engine):
    """K = 0 server mode against colocated vLLM: the same weights, seeds and sampling options
    give the same completions, token for token, and the same log-probs to BOUND; in a
    multi-turn rollout too (scripted tool turns: each turn a request from the row's token ids,
    its group's turns on one server)."""
    from _turns import ScriptedTurns

    from grpo_fast.trainer.rollout.engines.vllm import VLLMGenerator

    tokenizer = engine.tokenizer
    stop, suffix = tokenizer.convert_tokens_to_ids("7"), tokenizer.encode("+=", add_special_tokens=False)
    config = GRPOConfig(generator="vllm", max_new_tokens=6, vllm_max_model_len=32)
    colocated = VLLMGenerator(engine.model, tokenizer, EngineSettings.of(config))
    try:
        here = colocated.generate(PROMPTS, 4, list(range(6)))
        here_turns = colocated.generate(PROMPTS[:2], 4, [0, 1], turns=ScriptedTurns(stop, suffix))
    finally:
        colocated.close()
    there = engine.generate(PROMPTS, 4, list(range(6)))
    scripted = ScriptedTurns(stop, suffix)
    there_turns = engine.generate(PROMPTS[:2], 4, [0, 1], turns=scripted)
    assert sum(scripted.answered.values()) > 0  # some turns were answered and continued
    for a, b in ((here, there), (here_turns, there_turns)):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.completion_mask, b.completion_mask)
        assert torch.equal(a.attention_mask, b.attention_mask) and (a.logprobs - b.logprobs).abs().max() < BOUND
    tool_tokens = (there_turns.attention_mask[:, -there_turns.completion_mask.shape[1] :] == 1) & (
        there_turns.completion_mask == 0
    )
    assert bool(tool_tokens.any()) and bool((there_turns.versions[tool_tokens] == -1).all())


def test_a_stalled_server_is_dropped_after_the_timeout_and_its_groups_go_to_the_other(engine, servers):
    """A server that stops answering but stays up (SIGSTOP) holds a rollout for at most
    vllm_server_timeout_s (5 s here): it is then down, and the other server samples its groups;
    woken (SIGCONT), it is readmitted at the next push. (An engine of its own, on the module
    engine's weights.)"""
    config = GRPOConfig(
        generator="vllm", vllm_mode="server", vllm_server_urls=list(servers), max_new_tokens=6, vllm_server_timeout_s=5
    )
    patient = make_generator("vllm", engine.model, engine.tokenizer, EngineSettings.of(config))
    patient.generate(PROMPTS, 4, list(range(6)))  # both servers at its version
    first, second = patient.servers
    os.killpg(servers[second.url].pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        out = patient.generate(PROMPTS, 4, list(range(6)))
        waited = time.monotonic() - start
    finally:
        os.killpg(servers[second.url].pid, signal.SIGCONT)
    assert second.down and "timed out" in second.error and not first.down
    assert waited < 5 + 10  # the timeout, then the first server's share of the groups
    assert out.input_ids.shape[0] == 24 and bool(out.completion_mask[:, 0].all())
    # woken, it answers again: the next push readmits it (checked, then pushed), and it samples
    patient.publish(patient.published + 1)
    assert not second.down and second.error is None and second.version == patient.published
    assert server_version(second.url) == str(patient.published)
    assert {s.url for s in patient._ready()} == {first.url, second.url}


def test_a_server_dying_mid_rollout_hands_its_groups_to_the_other_then_none_left_is_an_error(engine, servers):
    """Last in the module: it kills the second server as the rollout sends it a group. Its
    groups go to the first; the rollout is whole, from the first server alone. With the first
    killed too, the next rollout stops with a ServerError naming both servers."""
    first, second = engine.servers
    request = engine._request

    def dying(server, verb, path, body=None, timeout=None):
        if path == "/v1/completions" and server is second and servers[second.url].poll() is None:
            stop(servers[second.url], signal.SIGKILL)
        return request(server, verb, path, body, timeout)

    engine._request = dying
    try:
        out = engine.generate(PROMPTS, 4, list(range(6)))
    finally:
        engine._request = request
    assert second.down and "mid-rollout" in second.error and not first.down
    assert out.input_ids.shape[0] == 24 and bool(out.completion_mask[:, 0].all())
    policy = completion_logprobs(engine.model, out.input_ids, out.attention_mask, out.completion_mask.shape[1])
    assert ((policy - out.logprobs) * out.completion_mask).abs().max() < BOUND
    assert engine.metrics()["vllm_servers_up"] == 1
    stop(servers[first.url], signal.SIGKILL)
    with pytest.raises(ServerError, match=f"{first.url}: stopped answering mid-rollout.*; {second.url}: stopped"):
        engine.generate(PROMPTS, 4, list(range(6)))
