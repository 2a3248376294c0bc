"""A hung rank on two GPUs, timed: `trainer launch` on 2 GPUs, SIGSTOP of rank 1 at global step 150,
every output line stamped with seconds since the stop, and the recovery time (stop -> the
restarted group's first step) from metrics.jsonl. Usage: python3 bench/hang.py DATA CKPT [overrides]"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

data, ckpt, extra = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
cmd = [
    sys.executable,
    "-m",
    "trainer",
    "launch",
    "--nproc-per-node",
    "2",
    "--config",
    "configs/default.yaml",
    "data.name=imagefolder",
    f"data.dir={data}",
    "data.cache_dir=/dev/shm/cache",
    "train.epochs=3",
    "train.log_every=25",
    "train.plot=false",
    "dist.timeout_s=30",
    "model.compile=false",
    f"checkpoint.dir={ckpt}",
    *extra,
]
agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
t0 = None
for line in agent.stdout:
    if t0 is None and "epoch 2/3 step 53/97" in line:
        for p in psutil.Process(agent.pid).children(recursive=True):
            if p.environ().get("RANK") == "1" and "trainer" in " ".join(p.cmdline()):
                p.send_signal(signal.SIGSTOP)
        t0 = time.time()
    if t0 is not None and "step" not in line[:40]:
        print(f"[{time.time() - t0:7.1f}s] {line.rstrip()[:300]}", flush=True)
agent.wait()
rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
starts = [round(r["time"] - t0, 1) for r in rows if r["event"] == "start" and r["time"] > t0]
first = [round(r["time"] - t0, 1) for r in rows if r["event"] == "first_step" and r["time"] > t0]
print(f"exit {agent.returncode}; restarted group's start at {starts} s, first step at {first} s after the stop")
