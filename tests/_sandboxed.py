"""What the code-reward and sandbox tests share: small limits, one scored completion, process lookup."""

import os

from grpo_fast.rewards import code_reward
from grpo_fast.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_time_s=2.0, memory_bytes=256 << 20, max_processes=8, output_bytes=64 << 10)
ROOT = os.geteuid() == 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def score(code: str, tests, limits: SandboxLimits = LIMITS, **columns) -> float:
    return code_reward(["prompt"], [code], tests=[tests], limits=limits, **{k: [v] for k, v in columns.items()})[0]


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids
