"""Print, for each plan JSON given, the profile's compute: forward, backward, optimizer and the
trainer's whole step in ms, the counted operations (GFLOP a step) and the rate they were run at
(TFLOP/s): against a device's peak, the utilization `plan --accelerator-tflops` would need."""

import json
import sys
from pathlib import Path

print(
    f"{'model':10} {'batch':>5} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>7} {'trainer ms':>10} "
    f"{'GFLOP':>8} {'TFLOP/s':>8}  compute"
)
for name in sys.argv[1:]:
    record = json.loads(Path(name).read_text())
    profile = record["profile"]
    trainer = (profile["trainer_step_s"] or 0.0) * 1e3
    print(
        f"{record['model']:10} {record['batch_size']:5d} {profile['forward_s'] * 1e3:8.2f} "
        f"{profile['backward_s'] * 1e3:8.2f} {profile['optimizer_s'] * 1e3:7.2f} {trainer:10.2f} "
        f"{profile['flops'] / 1e9:8.1f} {profile['counted_tflops_per_s']:8.3f}  {record['compute']}"
    )
