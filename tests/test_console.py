"""trainer/launch/console.py: torch's native stderr lines go to the run folder, the project's stay on the console."""

from __future__ import annotations

import io
import re
import sys

import pytest
from conftest import env, run

from trainer.launch.console import NATIVE, Relay

# what a survivor printed when the peer holding the workers' store was lost (issue 49), shortened; the
# "<omitting python frames>" line reached the console on the test bed (2026-12-06)
LOST_STORE = b"""\
epoch 2/4 step 40/97 loss 1.2345 5,000 img/s eta 0m30s
[rank1]:[W1206 07:02:11.123456789 TCPStore.cpp:125] [c10d] sendBytes failed on SocketImpl(fd=12): Broken pipe
Exception raised from sendBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:653 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f00 in libc10.so)
frame #1: <unknown function> + 0x5a1c (0x7f01 in libtorch_cpu.so)
<omitting python frames>

frame #43: __libc_start_main + 0x80 (0x7f02 in libc.so.6)
E1206 07:02:12.000000 311 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -9) local_rank: 0 (pid: 312) of binary
rank 1 (node2) lost rank 0 (node1) at step 137: torchrun goes back to its rendezvous to re-form the group
"""


def test_native_lines_and_their_backtraces_leave_the_console_and_the_projects_stay(tmp_path):
    console = io.BytesIO()
    relay = Relay(io.BytesIO(LOST_STORE), tmp_path / "run" / "native-stderr.txt", console).start()
    relay.join()
    assert console.getvalue().decode().splitlines() == [
        "epoch 2/4 step 40/97 loss 1.2345 5,000 img/s eta 0m30s",
        "rank 1 (node2) lost rank 0 (node1) at step 137: torchrun goes back to its rendezvous to re-form the group",
    ]
    kept = (tmp_path / "run" / "native-stderr.txt").read_bytes()
    assert relay.diverted == 8 and kept.count(b"frame #") == 3 and b"failed (exitcode: -9)" in kept
    assert not NATIVE.match(b"Warning: a Python warning stays\n") and not NATIVE.match(b"error: train.batch_size ...\n")


@pytest.mark.slow
def test_torchs_native_lines_of_a_real_run_go_to_the_run_folder(tmp_path):
    """Two gloo ranks under `trainer torchrun` with c10d's C++ logging on (TORCH_CPP_LOG_LEVEL=INFO:
    socket and reducer lines from every process) and torchrun's banner (no OMP_NUM_THREADS)."""
    e = env(TORCH_CPP_LOG_LEVEL="INFO")
    e.pop("OMP_NUM_THREADS")
    p = run(
        [
            sys.executable,
            "-m",
            "trainer",
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "trainer",
            "train",
            "--config",
            "configs/smoke.yaml",
            "train.epochs=1",
            "train.plot=false",
            f"checkpoint.dir={tmp_path}",
        ],
        env=e,
    )
    assert "done: step 32" in p.stdout + p.stderr
    assert not [line for line in p.stderr.splitlines() if NATIVE.match(line.encode())], p.stderr[-3000:]
    kept = (tmp_path / "native-stderr.txt").read_text()
    assert re.search(r"^\[rank[01]\]:\[I\d{4} .*\] ", kept, re.M) and "OMP_NUM_THREADS" in kept, kept[:2000]


def test_a_console_that_is_gone_does_not_stop_the_stream_being_read(tmp_path):
    class Gone(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError

    source = io.BytesIO(b"a line\n" * 100_000 + b"[W1206 07:02:11.1 socket.cpp:1] [c10d] last\n")
    relay = Relay(source, tmp_path / "native-stderr.txt", Gone()).start()
    relay.join()
    assert source.tell() == len(source.getvalue()) and relay.diverted == 1
