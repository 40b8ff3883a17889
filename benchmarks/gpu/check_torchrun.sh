#!/usr/bin/env bash
# The multi-device trainer on this machine's device, one process under torchrun: what CI's
# gloo-on-CPU tests cannot reach on CUDA (NCCL, the rank's current device, FSDP2's device mesh
# and bf16 policy, CUDA random states in checkpoints). The demo trains 2 steps under FSDP2 and
# checkpoints; a second launch resumes that checkpoint under DDP (resharded) for 2 more; then
# the run must hold 4 metric rows and a final model. Called by run_all.sh.
set -euo pipefail
run=$(mktemp -d)/run
launch=(python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m grpo_fast train --no-progress
    --save-every 2 --output "$run")
"${launch[@]}" --steps 2 --parallel fsdp
"${launch[@]}" --steps 4 --parallel ddp --resume
python3 - "$run" <<'PY'
import json, os, sys

run = sys.argv[1]
steps = [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))]
assert steps == [1, 2, 3, 4], steps
assert os.path.isfile(os.path.join(run, "final", "config.json")), os.listdir(run)
print(f"torchrun: FSDP2 2 steps, resumed under DDP to step 4, final model written ({run})")
PY
