"""Measurement helpers shared by the benchmarks: timing quantiles, peak memory, host reads.

Peak memory on CPU is the growth of the peak resident set of a fresh process that runs
one configuration (docs/design.md, "How we measure"): ``run_isolated`` starts
``ARGV --worker JSON``, and the worker reports ``peak_rss_growth`` around what it measures.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def quantiles(samples):
    """Median, 20% and 80% quantiles of a list of seconds."""
    q = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else samples * 4
    return {"median_s": statistics.median(samples), "p20_s": q[0], "p80_s": q[3], "repeats": len(samples)}


def time_fn(fn, *, warmup: int = 1, repeats: int = 5, setup=None):
    """Calls ``fn`` ``warmup`` times, then times ``repeats`` calls (``setup`` runs untimed before each)."""
    setup = setup or (lambda: None)
    for _ in range(warmup):
        setup()
        fn()
    samples = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return quantiles(samples)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Lowers the kernel's high-water mark of this process's resident set (VmHWM) to its RSS
    now, so that an earlier, higher peak (a warm-up call, the libraries' loading) does not hide
    the next one that :func:`peak_rss_bytes` reads."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The process's peak resident set since it started or since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_rise_from_here():
    """A function giving the bytes by which the process's peak RSS has risen above its RSS now,
    read as often as wanted, from a reset high-water mark (:func:`reset_peak_rss`)."""
    reset_peak_rss()
    before = current_rss_bytes()
    return lambda: peak_rss_bytes() - before


def peak_rss_growth(fn, reset: bool = False) -> int:
    """Bytes by which the process's peak RSS rises above its current RSS while ``fn`` runs.
    ``reset``: measured from a reset high-water mark (:func:`rss_rise_from_here`)."""
    if reset:
        risen = rss_rise_from_here()
        fn()
        return max(0, risen())
    before = current_rss_bytes()
    fn()
    return max(0, peak_rss_bytes() - before)


def cuda_peak_extra_bytes(fn, device: str):
    """Peak bytes allocated during one call of ``fn`` on top of what existed before it;
    None (and ``fn`` not called) off CUDA, where the allocator keeps no such count."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (tensors detached first; ||out - ref|| when ref is all
    0); NaN anywhere gives inf. The benchmarks' accuracy column and the tests' error measure."""
    out, ref = out.detach().double(), ref.detach().double()
    if out.isnan().any() or ref.isnan().any():
        return float("inf")
    den, num = ref.norm().item(), (out - ref).norm().item()
    return num / den if den > 0 else num


def run_isolated(argv: list, config: dict, timeout: float = 1800, env=None) -> dict:
    """Runs ``argv + ["--worker", JSON]`` in a fresh interpreter (environment ``env``, default
    this one's); returns the JSON it prints last, or ``{"error": last line of stderr}``."""
    command = [*argv, "--worker", json.dumps(config)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_info() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_table(rows, columns):
    """Prints a Markdown table of dicts (missing values as '-')."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |")


class HostReads(TorchDispatchMode):
    """Counts, inside the block, the calls that make the host wait for the device on CUDA,
    whatever device runs them (so a CPU run counts what a GPU run would wait for): reads of a
    tensor's value (``.item()``, ``float()``, ``int()``, ``bool()``: ``_local_scalar_dense``;
    ``.tolist()``), copies to the host, and ops whose output size depends on the values
    (``nonzero``, ``masked_select``, boolean indexing, ``unique``, ``repeat_interleave``
    without ``output_size``). ``calls`` lists them in order; ``count`` is their number.

    Reads that a CUDA run does not make are left out: the argument checks' value checks
    (``ops/_validate.py`` skips them on CUDA tensors) and torch's optimizers reading their
    step counters (host tensors on any device unless ``capturable``).
    """

    WAITING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
    HOST_ONLY = (os.path.join("grpo_fast", "ops", "_validate.py"), os.path.join("torch", "optim", ""))

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        waits = name in self.WAITING
        waits |= name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor)
        waits |= name == "_to_copy" and args[0].is_cuda and kwargs.get("device", args[0].device).type == "cpu"
        if waits and not self._host_only():
            self.calls.append(name)
        return func(*args, **kwargs)

    def _host_only(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if any(part in frame.f_code.co_filename for part in self.HOST_ONLY):
                return True
            frame = frame.f_back
        return False

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        calls, tolist = self.calls, self._tolist

        def counted_tolist(tensor):  # on a CPU tensor .tolist() reads memory without an op
            calls.append("tolist")
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
