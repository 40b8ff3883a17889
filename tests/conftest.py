"""Test setup: Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the
top of the first module pytest loads. ``GRPO_FAST_TEST_CUDA=1`` keeps real CUDA kernels.
"""

import contextlib
import glob
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

if os.environ.get("GRPO_FAST_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from grpo_fast import reference  # noqa: E402
from grpo_fast.bench.measure import rel_err  # noqa: E402, F401  (the tests' whole-tensor error)

# The README's test command runs a pytest-xdist worker per core (-n 2), each module on one worker
# (--dist loadfile: what a module builds once is built once); one thread each, so that the two
# never fight over a core. Run without -n, a test has both.
torch.set_num_threads(1 if "PYTEST_XDIST_WORKER" in os.environ else min(2, os.cpu_count() or 1))

# The modules whose tests take longest (a worker's seconds under -n 2 --dist loadfile,
# --durations=0, 2026-12-07), longest first: collected first, since loadfile hands a module to
# a worker in collection order (with xdist's loadscope reordering off, pytest_configure below:
# it would order modules by their number of tests), so that neither worker ends the run alone
# on one of them.
LONGEST_MODULES = (
    "test_real_models.py",  # 170 s
    "test_distributed.py",  # 161 s
    "test_gpu_script.py",  # 148 s
    "test_vllm_server.py",  # 142 s (two vLLM servers start in 70-80 s of it)
    "test_async_rollout.py",  # 136 s
    "test_faults.py",  # 134 s
    "test_vllm.py",  # 134 s
    "test_guess_number.py",  # 130 s
    "test_bench_trainer.py",  # 79 s
    "test_real_model_sampling.py",  # 75 s
    "test_soak_sandbox.py",  # 71 s
    "test_sandbox.py",  # 71 s
    "test_ops.py",  # 70 s
    "test_gpu_compile.py",  # 66 s
    "test_memory_bench.py",  # 49 s
    "test_sequence_parallel.py",  # 42 s
)


def pytest_configure(config):
    # xdist's --no-loadscope-reorder, set here rather than in pyproject's addopts: a pytest
    # without xdist (the GPU image's, run_all.sh's benchmark stage) would refuse the flag
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def float64_norms(monkeypatch):
    """Llama's RMSNorm in the input's dtype for this test (tests/_float64.py says why)."""
    from _float64 import patch_llama_norms

    patch_llama_norms(monkeypatch)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The padded batch's logits that predict the completion tokens, [N, C, V]: what the
    trainer's packed forwards are checked against. ``logits_to_keep`` runs the LM head on
    positions L-C-1 .. L-2 only (each predicts the next token)."""
    from grpo_fast.trainer.rollout.engines import position_ids

    L, C = input_ids.shape[1], num_completion_tokens
    keep = torch.arange(L - C - 1, L - 1, device=input_ids.device)
    positions = position_ids(attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=keep).logits


@torch.no_grad()
def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int):
    """The completion tokens' log-probs under ``model`` from the padded batch: [N, C], no grad."""
    import grpo_fast

    C = num_completion_tokens
    return grpo_fast.token_logprobs(completion_logits(model, input_ids, attention_mask, C), input_ids[:, -C:])


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Element-wise error: max |out - ref| / max |ref| in float64 (the largest error when ref is
    all 0); NaN anywhere gives inf. Where :func:`rel_err`'s whole-tensor norm lets a few wrong
    elements through, this does not: every gradient comparison checks both."""
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    if out.isnan().any() or ref.isnan().any():
        return float("inf")
    if not ref.numel():
        return 0.0
    scale, worst = ref.abs().max().item(), (out - ref).abs().max().item()
    return worst / scale if scale > 0 else worst


METRICS = ("kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "ratio_mean", "entropy")


def assert_metrics_match(out, expected, tol: float) -> None:
    """Every metric of the LossOutput ``out`` is detached and equals ``expected``'s within
    ``tol`` relative (absolute below 1), or both are None."""
    for name in METRICS:
        got, want = getattr(out, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert not got.requires_grad, name
            assert abs(got.item() - want.item()) <= tol * max(1.0, abs(want.item())), name


def batch_args(case: dict) -> tuple:
    """The per-token arguments of a loss op, in order, from a case of :func:`make_case`."""
    return case["ids"], case["advantages"], case["mask"], case["old_logprobs"], case["ref_logprobs"]


# torch: the CPU path's eager chunks; compiled: the same path as the kernels inductor builds
# from its row math (GRPO_FAST_CPU_COMPILE=1, whatever the size); triton: the kernels under
# TRITON_INTERPRET=1 on CPU.
BACKENDS = ["torch", "compiled", "triton"]
# a test's device parameter: CPU always, CUDA where there is one (run_all.sh runs these with
# GRPO_FAST_TEST_CUDA=1 on the GPU machine)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    compiled = request.param == "compiled"
    monkeypatch.setenv("GRPO_FAST_BACKEND", "torch" if compiled else request.param)
    monkeypatch.setenv("GRPO_FAST_CPU_COMPILE", "1" if compiled else "0")
    return request.param


def make_case(B=3, T=5, V=37, *, dtype=torch.float32, regime="unclipped", seq_adv=True, strided=False, seed=0):
    """Random logits and the tensors of a GRPO batch.

    regime: "on_policy" (no old log-probs), "unclipped" (ratios within 1 +- 0.05) or
    "clipped" (ratios from 0.55 to 2, so both clip bounds are crossed in every row).
    """
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(B, T + 1, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    logits = full[:, :-1] if strided else full[:, :T].contiguous()
    ids = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logp = reference.token_logprobs(logits.double(), ids)
    noise = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.1 - 0.05
    if regime == "clipped":  # every row crosses both bounds: log-ratios cycle through this pattern
        pattern = torch.tensor([-0.6, 0.7, -0.1, 0.4, 0.05], dtype=torch.float64)
        noise = noise / 5 + pattern.repeat(T // 5 + 1)[:T]
    old = None if regime == "on_policy" else logp - noise
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g) if seq_adv else torch.randn(B, T, generator=g)
    adv[0] = abs(adv[0]) + 0.5  # both signs of A, whatever the seed
    adv[1] = -abs(adv[1]) - 0.5
    mask = torch.ones(B, T)
    mask[-1, T // 2 :] = 0
    return dict(logits=logits, ids=ids, advantages=adv, mask=mask, old_logprobs=old, ref_logprobs=ref)


def trl_sampling_correction(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vllm_importance_sampling_correction (GRPOTrainer._generate_and_score_completions),
    restated step by step in float64: masked log-ratio, NaN sampling log-probs count 0, a sum over
    the sequence for sequence_* modes, then clamp (truncate) or zero outside the bounds (mask)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# ---------------------------------------------------------------- small runs
# The demo task at a size where a step takes tens of milliseconds: 4 prompts of 4 samples, 3 tokens.
SMALL = dict(batch_size=16, group_size=4, max_new_tokens=3, progress=False)


def small_config(tmp_path, **overrides):
    """A :class:`GRPOConfig` of the SMALL run writing to ``tmp_path/run``, with ``overrides``."""
    from grpo_fast.trainer import GRPOConfig

    return GRPOConfig(**{**SMALL, "output_dir": str(tmp_path / "run"), **overrides})


def write_jsonl(path, rows) -> str:
    """Writes ``rows`` (dicts) to the pathlib ``path`` as JSON lines; returns the path as a str."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def make_chat_tokenizer():
    """A word-level tokenizer whose chat template marks each role: <|user|>Hi\n<|assistant|>."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]", chat_template=template
    )


def one_thread(run):
    """``run()`` with one torch thread in this process, as each rank and the CLI's demo run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


def without_timings(rows: list) -> list:
    """Metrics rows without the keys that measure time or memory (they differ run to run)."""
    from grpo_fast.trainer.run.run_log import TIMING_KEYS

    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in rows]


def signal_in_step(trainer, step: int, signum=signal.SIGTERM) -> None:
    """``trainer`` signals its own process as it asks its rollout source for step ``step``'s
    batch (a scheduler's preemption arriving mid-step), whatever the source and engine."""
    source = trainer.source
    next_batch = source.next

    def next(position, version):
        if trainer.step + 1 == step:
            os.kill(os.getpid(), signum)
        return next_batch(position, version)

    source.next = next


def same_weights(one, other) -> bool:
    """The two trainers' policies hold bit-equal weights."""
    return all(torch.equal(p, q) for p, q in zip(one.policy.state_dict().values(), other.policy.state_dict().values()))


def assert_rows_close(rows: list, expected: list, rel: float) -> None:
    """Metrics rows equal ``expected`` row for row, key for key (timings aside), to ``rel``."""
    from grpo_fast.trainer.run.run_log import TIMING_KEYS

    assert len(rows) == len(expected)
    for got, want in zip(rows, expected):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key not in TIMING_KEYS:
                assert got[key] == pytest.approx(value, rel=rel, abs=1e-6), (want["step"], key)


# ---------------------------------------------------------------- child processes and torchrun
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def torchrun_command(*args) -> list:
    """``torchrun --standalone --nproc-per-node=2 ARGS`` as this interpreter runs it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]


def child_env(**extra) -> dict:
    """This environment, tests/ importable (the helper rewards), one thread per process."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    # no GPU either: on a GPU host rank 1 would ask for cuda:1, and the tests expect gloo
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)


def run_child(command: list, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Runs ``command`` in :func:`child_env` (``env`` added) to its end; output captured."""
    return subprocess.run(command, env=child_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@contextlib.contextmanager
def start_child(command: list, timeout: float = 300, **env):
    """Starts ``command`` in :func:`child_env` (``env`` added) and yields its Popen, so that the
    block can work while it runs; on leaving, waits for its end (killing it after ``timeout``
    seconds, or at once when the block raised) and sets its ``stderr`` to the text it wrote."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command, env=child_env(**env), stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT
        )
        try:
            yield proc
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.terminate()  # torchrun passes it on to its ranks
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            err.seek(0)
            proc.stderr = err.read()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list:
    """Pids of ``pid``'s children, whichever of its threads started them ([] once it is gone)."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                found += [int(child) for child in f.read().split()]
        except OSError:  # the thread ended
            continue
    return found


def worker_pids(launcher: int) -> dict:
    """{rank: pid} of the processes torchrun (pid ``launcher``) started."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if parent == launcher and b"RANK" in environ:
            ranks[int(environ[b"RANK"])] = int(entry)
    return ranks


def wait_until(condition, timeout: float) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (polled every 0.1 s)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()
