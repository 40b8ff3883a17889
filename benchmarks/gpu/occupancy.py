"""Registers, spills, shared memory, occupancy and bytes in flight of every Triton kernel
configuration the launchers pick, compiled for sm_80 and sm_90 on a machine without a GPU.

    python3 benchmarks/gpu/occupancy.py                    # table for sm_80 and sm_90
    python3 benchmarks/gpu/occupancy.py --knobs            # + launch-knob variants (BLOCK_V x warps)
    python3 benchmarks/gpu/occupancy.py --json occ.json    # + every row as JSON
    python3 benchmarks/gpu/occupancy.py --launches l.json  # capture once, compile with each Triton

Three steps, so that nothing about a configuration is written down by hand:

1. Capture (a subprocess under ``TRITON_INTERPRET=1``): the public ops run on small CPU
   tensors shaped like real use (V = 151936, 32001; a ``logits[:, :-1]`` slice; a
   transposed view; bf16 and fp32; entropy and gradient on and off; every loss type; the
   fused LM head; group advantages), and every kernel launch is recorded as the launcher
   made it: pointer dtypes and 16-byte alignment, integers, constexprs, ``num_warps``.
2. Compile (a subprocess without the interpreter): each recorded launch goes to the real
   ``JITFunction.warmup`` under a stand-in driver whose target is sm_80 or sm_90, so Triton
   specialises the arguments exactly as a launch on that GPU would (an integer 1 such as
   ``stride_v`` becomes a constant, multiples of 16 get the divisibility hint) and runs its
   whole pipeline through ptxas; ``cuobjdump -res-usage`` reads the cubin.
3. Model (CUDA's occupancy rules, per SM): registers are allocated per warp in units of
   256 within each of the 4 sub-partitions (16384 registers each), at most 64 warps and
   32 CTAs; each CTA also takes Triton's dynamic shared memory, the cubin's static shared
   memory and 1 KiB reserved by the driver. A streaming kernel (one that sweeps a
   vocabulary row in ``BLOCK_V`` steps) issues the loads of one whole block before it uses
   any (Triton does not software-pipeline loads that do not feed a ``tl.dot``), so each
   resident CTA has ``BLOCK_V * element size`` bytes of loads in flight:
   bytes in flight per SM = CTAs per SM * BLOCK_V * bytes per logit.
   Little's law sets what is needed: bandwidth * latency / SMs. An H200 copies at about
   4.3 TB/s and its DRAM latency under load is about 0.6-1 us, so 20-33 KB per SM
   (benchmarks/NOTES.md, "Occupancy and bytes in flight", derives it).
"""

import argparse
import collections
import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = (80, 90)
# Per SM, for compute capability 8.0 (A100) and 9.0 (H100/H200): CUDA's occupancy calculator.
SM = dict(regs=65536, sub_partitions=4, reg_unit=256, max_warps=64, max_ctas=32, reserved_smem=1024)
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SMS = {80: 108, 90: 132}
# Little's law on an H200 (benchmarks/NOTES.md): 4.3 TB/s * 0.6-1 us / 132 SMs.
NEEDED_BYTES_PER_SM = (20_000, 33_000)
MIN_STREAMING_WARPS = 16  # the CI rule: a streaming kernel below this cannot keep HBM busy
KNOB_BLOCKS = (1024, 2048, 4096, 8192, 16384)
KNOB_WARPS = (4, 8, 16)
# --knobs varies BLOCK_V and warps for the launches of these scenarios (the hot paths).
KNOB_SCENARIOS = (
    "loss bf16 slice, entropy (trainer)",
    "loss bf16 slice",
    "logprobs bf16 fwd+bwd",
    "logprobs bf16 no grad, entropy (reference model)",
)
# The smallest vocabulary that specialises as a real one does: BLOCK_V at its cap (4096, or
# 1024 along a strided vocabulary), more than one block per row, V % 16 == 0.
SMALL_V = 8192


# ---------------------------------------------------------------- 1. capture (interpreter)


def scenarios():
    """(name, fn) pairs that call the public ops the way training and inference do."""
    import torch

    import grpo_fast

    def batch(V, dtype, B=2, T=3, layout="slice"):
        """logits [B, T, V] in a layout of real use, ids, per-token inputs of a GRPO step."""
        g = torch.Generator().manual_seed(0)
        if layout == "slice":  # model output [B, T + 1, V], the loss reads [:, :-1] in place
            logits = (torch.randn(B, T + 1, V, generator=g) * 2).to(dtype)[:, :-1]
        elif layout == "transposed":  # a non-unit vocabulary stride
            logits = (torch.randn(B, V, T, generator=g) * 2).to(dtype).transpose(1, 2)
        else:
            logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
        ids = torch.randint(0, V, (B, T), generator=g)
        logp = torch.randn(B, T, generator=g) - 8
        return dict(
            logits=logits,
            ids=ids,
            advantages=torch.randn(B, generator=g),
            mask=torch.ones(B, T),
            old_logprobs=logp + 0.2 * torch.randn(B, T, generator=g),
            ref_logprobs=logp,
        )

    def loss(V=151936, dtype=torch.bfloat16, layout="slice", grad=True, inplace=False, on_policy=False, T=3, **options):
        def run():
            b = batch(V, dtype, layout=layout, T=T)
            if on_policy:  # no old or reference log-probs: ratio 1, no KL term
                b.update(old_logprobs=None, ref_logprobs=None)
            x = b.pop("logits").detach().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                out = grpo_fast.grpo_loss(x, *b.values(), inplace_backward=inplace, **options)
                if grad:
                    (2 * out.loss).backward()  # dL/dloss != 1: the rescale kernel does the work

        return run

    def logprobs(V=151936, dtype=torch.bfloat16, layout="slice", grad=True, entropy=False):
        def run():
            b = batch(V, dtype, layout=layout)
            x = b["logits"].detach().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                out = grpo_fast.token_logprobs(x, b["ids"], temperature=0.9, return_entropy=entropy)
                if grad:
                    (out[0] if entropy else out).sum().backward()

        return run

    def fused_linear(dtype=torch.bfloat16, **options):
        def run():
            V, H, B, T = SMALL_V, 64, 2, 3
            b = batch(V, dtype)
            g = torch.Generator().manual_seed(1)
            hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
            weight = (torch.randn(V, H, generator=g) * 0.05).to(dtype).requires_grad_()
            bias = torch.zeros(V, dtype=dtype, requires_grad=True)
            del b["logits"]
            out = grpo_fast.fused_linear_grpo_loss(hidden, weight, *b.values(), bias=bias, chunk_size=4, **options)
            out.loss.backward()
            grpo_fast.fused_linear_token_logprobs(hidden.detach(), weight.detach(), b["ids"], return_entropy=True)

        return run

    def advantages(N, G, K, scale):
        def run():
            rewards = torch.rand(N, K) if K > 1 else torch.rand(N)
            weights = torch.rand(K) if K > 1 else None
            grpo_fast.group_advantages(rewards, G, scale=scale, reward_weights=weights)

        return run

    kl = dict(beta=0.04)
    # Qwen's V = 151936 for the hot paths (KNOB_SCENARIOS); V = SMALL_V where only an option, the
    # dtype or the layout varies: the same specialisation, a nineteenth of the interpreter's time.
    small = dict(V=SMALL_V, **kl)
    cases = [
        ("loss bf16 slice, entropy (trainer)", loss(return_entropy=True, **kl)),
        ("loss bf16 slice", loss(**kl)),
        ("loss bf16 slice, in-place grad", loss(inplace=True, **small)),
        ("loss bf16, no grad", loss(grad=False, return_entropy=True, **small)),
        ("loss fp32 slice, entropy", loss(dtype=torch.float32, return_entropy=True, **small)),
        ("loss fp32 slice", loss(dtype=torch.float32, **small)),
        ("loss bf16 V=32001 (odd)", loss(V=32001, return_entropy=True, **kl)),
        ("loss bf16 transposed (stride_v != 1)", loss(layout="transposed", return_entropy=True, **small)),
        ("loss bf16 transposed, no entropy", loss(layout="transposed", **small)),
        (
            "loss bf16 transposed T=16 (stride_v % 16 == 0)",
            loss(T=16, layout="transposed", return_entropy=True, **small),
        ),
        ("loss fp32 transposed, entropy", loss(dtype=torch.float32, layout="transposed", return_entropy=True, **small)),
        ("loss bf16 contiguous, on-policy, beta 0", loss(V=SMALL_V, layout="contiguous", on_policy=True)),
        ("loss gspo (sequence)", loss(importance_sampling="sequence", return_entropy=True, **small)),
        (
            "loss gspo fp32 transposed",
            loss(dtype=torch.float32, layout="transposed", importance_sampling="sequence", V=SMALL_V),
        ),
    ]
    extra = dict(dr_grpo=dict(max_completion_length=8), cispo=dict(eps_high=5.0))
    for loss_type in ("bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"):
        cases.append((f"loss {loss_type}", loss(loss_type=loss_type, **extra.get(loss_type, {}), **small)))
    cases += [(f"loss kl {k}", loss(kl_estimator=k, **small)) for k in ("k1", "k2")]
    cases += [
        ("logprobs bf16 no grad, entropy (reference model)", logprobs(grad=False, entropy=True)),
        ("logprobs bf16 no grad", logprobs(grad=False)),
        ("logprobs bf16 fwd+bwd", logprobs()),
        ("logprobs fp32 fwd+bwd, entropy", logprobs(V=SMALL_V, dtype=torch.float32, entropy=True)),
        ("logprobs bf16 transposed fwd+bwd", logprobs(V=SMALL_V, layout="transposed")),
        ("logprobs bf16 V=32001 fwd+bwd", logprobs(V=32001)),
        ("fused linear bf16 token", fused_linear(**kl)),
        ("fused linear bf16 sequence", fused_linear(importance_sampling="sequence", **kl)),
        ("fused linear fp32 token", fused_linear(dtype=torch.float32, **kl)),
    ]
    cases += [
        (f"group_advantages N={n} G={g} K={k} {s}", advantages(n, g, k, s))
        for n, g, k, s in ((64, 8, 1, "group"), (1024, 16, 3, "batch"), (256, 16, 2, "none"))
    ]
    return cases


def describe(value):
    """A JSON-able record of one kernel argument, enough to rebuild its specialisation."""
    import torch

    if isinstance(value, torch.Tensor):
        return dict(tensor=str(value.dtype).replace("torch.", ""), align=value.data_ptr() % 16)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return dict(value=value)
    if hasattr(value, "value"):  # tl.constexpr
        return dict(value=value.value)
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


def capture() -> list:
    """Runs every scenario under the interpreter and returns the launches it made."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, current = [], [None]
    original_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = list(inspect.signature(self.fn).parameters)
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        options = {k: v for k, v in kwargs.items() if k not in params}
        grid = grid if isinstance(grid, tuple) else (grid,)
        launches.append(
            dict(
                kernel=f"{self.fn.__module__}:{self.fn.__name__}",
                scenario=current[0],
                args={k: describe(v) for k, v in bound.items()},
                options=options,
                programs=int(grid[0]),
            )
        )
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        for name, fn in scenarios():
            current[0] = name
            fn()
    finally:
        InterpretedFunction.run = original_run
    return launches


# ---------------------------------------------------------------- 2. compile (no interpreter)


class TargetDriver:
    """Stands in for the CUDA driver: reports a GPU target and device 0, launches nothing."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def rebuild(record):
    """A kernel argument as the launcher passed it (a tensor only needs dtype and alignment)."""
    import torch

    if "tensor" in record:
        dtype = getattr(torch, record["tensor"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(64, dtype=dtype)[record["align"] // itemsize :]
    return record["value"]


def res_usage(cubin: bytes) -> dict:
    """Registers, stack, local (spill) and static shared bytes from ``cuobjdump -res-usage``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def spills(ptxas_log: str) -> dict:
    """Spill stores and loads (bytes per thread) from ptxas's own ``-v`` report of the build."""
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if found is None:
        raise RuntimeError(
            f"no ptxas -v report in the compile output (TRITON_DUMP_PTXAS_LOG unset?): {ptxas_log[:500]}"
        )
    return dict(spill_stores=int(found[1]), spill_loads=int(found[2]))


def specialisation(fn, args, options) -> str:
    """What Triton specialised on, as a launch would: constants (declared and integer 1),
    pointer dtypes, and the integers it knows to be multiples of 16."""
    binder = fn.device_caches[0][-1]
    _, spec, _ = binder(*args, **options)
    parts = []
    for param, (kind, attr) in zip(fn.arg_names, spec):
        if kind == "constexpr" and not fn.params[fn.arg_names.index(param)].is_constexpr:
            parts.append(f"{param}=1")
        elif kind.startswith("*") and param == fn.arg_names[0]:
            parts.append(f"{param}:{kind[1:]}")
        elif kind in ("i32", "i64") and attr == "D":
            parts.append(f"{param}%16")
    return " ".join(parts)


def compile_launches(launches: list, knobs: bool, cc: int) -> list:
    """Compiles each distinct launch for sm_``cc``; returns one row per compiled kernel."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    jobs = collections.OrderedDict()  # (kernel, args, options) -> scenarios that launched it
    for launch in launches:
        variants = [(launch["args"], launch["options"], False)]
        if knobs and "BLOCK_V" in launch["args"] and launch["scenario"] in KNOB_SCENARIOS:
            for block in KNOB_BLOCKS:
                for warps in KNOB_WARPS:
                    args = dict(launch["args"], BLOCK_V=dict(value=block))
                    variants.append((args, dict(launch["options"], num_warps=warps), True))
        for args, options, knob in variants:
            key = json.dumps([launch["kernel"], args, options], sort_keys=True)
            jobs.setdefault(key, dict(launch=launch, args=args, options=options, knob=knob, scenarios=[]))
            jobs[key]["scenarios"].append(launch["scenario"])

    rows, seen = [], {}
    driver.set_active(TargetDriver(GPUTarget("cuda", cc, 32)))
    for job in jobs.values():
        module, name = job["launch"]["kernel"].split(":")
        fn = getattr(importlib.import_module(module), name)
        args = [rebuild(job["args"][p]) for p in fn.arg_names]
        options = dict(job["options"])
        row = dict(
            kernel=name,
            cc=cc,
            constexprs={
                p: job["args"][p]["value"] for p in fn.arg_names if fn.params[fn.arg_names.index(p)].is_constexpr
            },
            num_warps=options.get("num_warps", 4),
            knob_variant=job["knob"],
        )
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v here
                kernel = fn.warmup(*args, grid=(1,), **options)
            row["specialisation"] = specialisation(fn, args, options)
        except Exception as error:  # a compile error is a finding, reported in the row
            row.update(error=f"{type(error).__name__}: {str(error).strip()[:2000]}", scenarios=job["scenarios"])
            rows.append(row)
            continue
        key = (name, kernel.hash)
        if key in seen:  # another launch that specialised to the same binary
            seen[key]["scenarios"] += [s for s in job["scenarios"] if s not in seen[key]["scenarios"]]
            continue
        row.update(
            res_usage(kernel.asm["cubin"]),
            **spills(log.getvalue()),
            dynamic_shared=kernel.metadata.shared,
            pipelined=".shared" in kernel.asm["ptx"] and "cp.async" in kernel.asm["ptx"],
            bytes_per_element=_element_bytes(job["args"][fn.arg_names[0]]),
            scenarios=list(job["scenarios"]),
        )
        row.update(occupancy(row, cc))
        seen[key] = row
        rows.append(row)
    return rows


def _element_bytes(record) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}.get(record.get("tensor"), 0)


# ---------------------------------------------------------------- 3. the occupancy model


def occupancy(row: dict, cc: int) -> dict:
    """CTAs and warps per SM, and bytes of loads in flight per SM for a streaming kernel."""
    warps = row["num_warps"]
    regs_per_warp = -(-row["reg"] * 32 // SM["reg_unit"]) * SM["reg_unit"]
    warps_by_regs = (SM["regs"] // SM["sub_partitions"] // regs_per_warp) * SM["sub_partitions"]
    smem = row["dynamic_shared"] + row["shared"] + SM["reserved_smem"]
    ctas = min(SM["max_ctas"], SM["max_warps"] // warps, warps_by_regs // warps, SMEM_PER_SM[cc] // smem)
    out = dict(ctas_per_sm=ctas, warps_per_sm=ctas * warps, streaming="BLOCK_V" in row["constexprs"])
    if out["streaming"]:
        out["bytes_in_flight_per_sm"] = ctas * row["constexprs"]["BLOCK_V"] * row["bytes_per_element"]
        out["rows_in_flight"] = ctas * SMS[cc]
    return out


def problems(row: dict) -> list:
    """Why a row fails the CI rule: a compile error, a spill, a starved streaming kernel."""
    if "error" in row:
        return [f"compile error: {row['error'].splitlines()[0]}"]
    found = []
    if row["spill_stores"] or row["spill_loads"]:
        found.append(f"spills: {row['spill_stores']} B stored, {row['spill_loads']} B loaded per thread")
    if row["streaming"] and row["warps_per_sm"] < MIN_STREAMING_WARPS:
        found.append(f"{row['warps_per_sm']} resident warps per SM < {MIN_STREAMING_WARPS} ({row['reg']} registers)")
    return found


def print_table(rows: list) -> None:
    print(
        "| kernel | cc | config | specialisation | regs | spill B | smem B | CTAs/SM | warps/SM | "
        "KB in flight/SM | scenarios |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        config = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r["constexprs"].items())
        config += f" warps={r['num_warps']}" + (" (knob)" if r["knob_variant"] else "")
        if "error" in r:
            print(f"| {r['kernel']} | {r['cc']} | {config} | | COMPILE ERROR | | | | | | {r['scenarios'][0]} |")
            continue
        smem = r["dynamic_shared"] + r["shared"]
        flight = f"{r['bytes_in_flight_per_sm'] / 1000:.0f}" if r["streaming"] else "-"
        used = r["scenarios"][0] + (f" (+{len(r['scenarios']) - 1})" if len(r["scenarios"]) > 1 else "")
        print(
            f"| {r['kernel']} | {r['cc']} | {config} | {r.get('specialisation', '')} | {r['reg']} | "
            f"{r['spill_stores']} | {smem} | {r['ctas_per_sm']} | {r['warps_per_sm']} | {flight} | {used} |"
        )


# ---------------------------------------------------------------- driver


def run_step(step: str, env_update: dict, payload: str = "") -> str:
    """Runs this file's ``--step`` in a fresh interpreter (capture and compile need different
    TRITON_INTERPRET settings at import time, so neither may share a process with the other)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        env_update, GRPO_FAST_BACKEND="triton", PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--step", step],
        input=payload,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"occupancy.py --step {step} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--knobs", action="store_true", help=f"also compile BLOCK_V {KNOB_BLOCKS} x warps {KNOB_WARPS}")
    parser.add_argument("--json", help="write every row (and the CI rule's verdict) here")
    parser.add_argument(
        "--launches",
        help="a capture to share between Triton versions (what the launchers pick does not depend on the "
        "Triton that compiles it): read from this file if it exists, else captured and written there",
    )
    parser.add_argument("--step", choices=("capture", "compile"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "capture":
        print(json.dumps(capture()))
        return 0
    if args.step == "compile":
        request = json.load(sys.stdin)
        print(json.dumps(compile_launches(request["launches"], request["knobs"], request["cc"])))
        return 0

    if args.launches and os.path.exists(args.launches):
        with open(args.launches) as f:
            launches = json.load(f)
    else:
        launches = run_step("capture", {"TRITON_INTERPRET": "1"})
        if args.launches:
            with open(args.launches, "w") as f:
                json.dump(launches, f)
    with tempfile.TemporaryDirectory() as cache:  # an empty cache: every kernel is built, so ptxas reports it
        env = {"TRITON_CACHE_DIR": cache, "TRITON_DUMP_PTXAS_LOG": "1"}

        def compile_for(cc):
            return run_step("compile", env, json.dumps(dict(launches=launches, knobs=args.knobs, cc=cc)))

        with ThreadPoolExecutor(len(TARGETS)) as pool:  # a process per target, at once (cache keys differ by target)
            rows = [row for part in pool.map(compile_for, TARGETS) for row in part]
    for row in rows:
        row["problems"] = [] if row["knob_variant"] else problems(row)
    print_table(rows)
    failing = [r for r in rows if r["problems"]]
    print(
        f"\n{len(launches)} launches captured, {len(rows)} compiled kernels; Little's law on an H200 needs "
        f"{NEEDED_BYTES_PER_SM[0] // 1000}-{NEEDED_BYTES_PER_SM[1] // 1000} KB in flight per SM."
    )
    for r in failing:
        print(
            f"FAIL {r['kernel']} sm_{r['cc']} {r['constexprs']} warps={r['num_warps']} "
            f"[{r.get('specialisation', '')}]: {'; '.join(r['problems'])}"
        )
    if args.json:
        import triton  # noqa: F401  (only for its version, in the report)

        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, launches=len(launches), rows=rows), f, indent=1)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
