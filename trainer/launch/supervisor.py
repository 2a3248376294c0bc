"""Keeps the exit status contract (trainer/contract.py: 0 finished, 75 stopped after saving, 2 bad
input, anything else a crash) at the process each launcher watches.

A worker alone keeps it (``python -m trainer train`` exits with these codes). Under torchrun it
does not: a signalled torchrun raises ``SignalException`` and exits 1 whatever its workers did, and
a worker's exit 2 is retried ``--max-restarts`` times like a crash. So every launcher runs torchrun
under :func:`supervise` (``trainer torchrun ...``, which ``trainer launch`` uses too):

- torchrun runs as a child in its own session; SIGTERM, SIGINT and SIGHUP reach it once, from us
  (SIGUSR1, which torchrun does not handle, goes on as SIGTERM); a second Ctrl-C kills it at once;
- each worker writes its exit code to ``$TRAINER_EXIT_DIR/<restart>-<rank>`` as it leaves;
- a worker's 2 stops torchrun at once (no restarts) and we exit 2; a signalled torchrun whose
  workers of the last attempt exited 75 gives 75; torchrun's 0 gives 0; any other end is a crash
  (torchrun's own code, never 0, 2 or 75).

In a Slurm job whose batch script does not look after it (TorchX's), trainer/launch/slurm.py stops the
workers before the time limit and requeues the job after their save, never after bad input.

Where the launcher retries only codes 128-255 (Kubeflow's ``restartPolicy: ExitCode``: 1-127 fail
the job, 128-255 replace the pod), ``TRAINER_EXIT_POLICY=exitcode`` keeps the contract there
(:func:`for_launcher`): 0 and 2 stay, 75 and crashes move up by 128 (75 -> 203, 1 -> 129, 124 ->
252; a signal's 128+N stays). The operator counts none of these retries against ``backoffLimit``,
so the policy brings its own bound: a node whose run crashes CRASHES_WITHOUT_PROGRESS times in a
row with no newer checkpoint exits 1, which fails the job, instead of holding its GPUs for ever.

A worker that makes no progress and cannot act on it itself (stopped, frozen) is killed while
torchrun runs, so that torchrun restarts the group (trainer/launch/liveness.py; its heartbeat files
in ``$TRAINER_EXIT_DIR``).
An agent left without workers longer than its rendezvous can take (it waits on a first node it
cannot reach, for ever) is ended with a crash code (:class:`LostRendezvous`).

Workers die with torchrun, and torchrun with us (``PR_SET_PDEATHSIG``): kill -9 of a launcher
leaves no orphan training on, and writing into a folder a relaunch already uses.

Nothing here imports torch: usage errors and ``--help`` stay fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer import contract
from trainer.config import Config
from trainer.contract import EXIT_CRASH, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, say
from trainer.launch import slurm
from trainer.launch.console import Relay
from trainer.launch.liveness import LostRendezvous, kill_hung_workers
from trainer.launch.node import node_cache_env, processes_per_node
from trainer.launch.torchrun_args import option, with_rdzv_defaults, worker_config
from trainer.runfolder import newest_complete

EXIT_POLICY_ENV = "TRAINER_EXIT_POLICY"
"""``exitcode``: the codes for a launcher that retries 128-255 only (see the module docstring)."""
RETRYABLE = 128
CRASHES_WITHOUT_PROGRESS = 3
"""Under the exitcode policy: crashes in a row on one node, with no newer checkpoint between them,
after which a crash is final (exit 1). TRAINER_CRASHES_WITHOUT_PROGRESS sets another number."""
CRASHES_FOLDER = ".crashes"
"""In checkpoint.dir: one small record per node (its host name) of its crashes since the newest
checkpoint."""

SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
FORWARDED = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGINT,
    signal.SIGHUP: signal.SIGHUP,
    signal.SIGUSR1: signal.SIGTERM,
}


def _records(folder: Path) -> list[tuple[int, str]]:
    """(exit code, error line) of each worker of the newest group (the one that wrote last)."""
    found: dict[str, list[tuple[int, str]]] = {}
    newest: dict[str, float] = {}
    for p in folder.glob("[0-9]*-*"):
        group, _, _ = p.name.partition("-")
        try:
            code, _, message = p.read_text().partition("\n")
            found.setdefault(group, []).append((int(code), message))
            newest[group] = max(newest.get(group, 0.0), p.stat().st_mtime)
        except (OSError, ValueError):
            continue
    return found[max(newest, key=newest.get)] if found else []


def recorded(folder: Path) -> list[int]:
    """Exit codes the workers of the newest attempt recorded."""
    return [code for code, _ in _records(folder)]


def _usage_message(folder: Path) -> str:
    """The bad-input line a worker of the newest attempt recorded ("" if none did)."""
    return next((m for c, m in _records(folder) if c == EXIT_USAGE and m), "")


def _say_usage_error(folder: Path) -> None:
    """The workers' bad-input line, once: a worker that fails first may take the others down before
    they print (torchrun stops the group), so the supervisor, not rank 0, says it."""
    if message := _usage_message(folder):
        say(message)


def verdict(torchrun_code: int, codes: list[int], signalled: bool = False) -> int:
    """The launcher's exit code from torchrun's and its workers' (see the module docstring). A stop
    passed on (``signalled``) before any worker started loses nothing: 75, as a worker stopped
    while starting exits."""
    if EXIT_USAGE in codes:
        return EXIT_USAGE
    if torchrun_code == 0:
        return EXIT_OK
    if codes and all(c == EXIT_PREEMPTED for c in codes):
        return EXIT_PREEMPTED
    if (
        signalled
        and not codes
        and torchrun_code in (-signal.SIGTERM, 128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGHUP)
    ):
        return EXIT_PREEMPTED
    if torchrun_code < 0:  # killed by a signal
        return 128 - torchrun_code
    return torchrun_code if torchrun_code not in (EXIT_OK, EXIT_USAGE, EXIT_PREEMPTED) else EXIT_CRASH


def exit_policy() -> str:
    """TRAINER_EXIT_POLICY: '' (the contract's own codes) or 'exitcode' (anything else is refused
    before torchrun starts: :func:`exit_policy_problem`)."""
    return os.environ.get(EXIT_POLICY_ENV, "").strip().lower()


def exit_policy_problem() -> str | None:
    """The one-line error for a policy that is none, else None (as slurm.margin_problem)."""
    if exit_policy() in ("", "exitcode"):
        return None
    return (
        f"{EXIT_POLICY_ENV}={exit_policy()!r} is not a policy; set it to exitcode (Kubeflow's restartPolicy: ExitCode) "
        "or leave it unset"
    )


def crash_budget(root: Path, host: str, limit: int) -> tuple[int, str | None]:
    """Note one more crash of ``host``; (crashes in a row without a newer checkpoint, the newest
    checkpoint's name). A newer checkpoint than at the last crash starts the count again."""
    newest = newest_complete(root) if root.is_dir() else None
    step = newest.name if newest else None
    record = root / CRASHES_FOLDER / f"{host}.json"
    try:
        last = json.loads(record.read_text())
    except (OSError, ValueError):
        last = {}
    crashes = last.get("crashes", 0) + 1 if last.get("step") == step else 1
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"step": step, "crashes": crashes, "limit": limit, "time": time.time()}))
    except OSError:  # a read-only or full volume: the crash is retried, uncounted
        pass
    return crashes, step


def for_launcher(code: int, run_dir: Path | None, policy: str) -> int:
    """The contract's code as the launcher's policy needs it (see the module docstring)."""
    if policy != "exitcode" or code in (EXIT_OK, EXIT_USAGE) or code >= RETRYABLE:
        return code
    if code != EXIT_PREEMPTED:
        limit = int(os.environ.get("TRAINER_CRASHES_WITHOUT_PROGRESS", CRASHES_WITHOUT_PROGRESS))
        host = os.environ.get("HOSTNAME") or socket.gethostname()  # a pod's name (the kubelet sets HOSTNAME)
        if run_dir is not None:
            crashes, step = crash_budget(run_dir, host, limit)
            if crashes >= limit:
                since = f"since {step} was saved" if step else "before any checkpoint"
                say(
                    f"{host}: {crashes} crashes in a row {since}, no progress: exit {EXIT_CRASH}, a final failure of "
                    f"the job; "
                    "the tracebacks are in the run folder (error-rank*.txt): fix the cause and submit again (the job "
                    "resumes from its newest "
                    "checkpoint)"
                )
                return EXIT_CRASH
    return RETRYABLE + code


def _watch(
    proc: subprocess.Popen, exit_dir: Path, watch: LostRendezvous, limit: slurm.TimeLimit | None, poll_s: float
) -> tuple[int, bool]:
    """Wait for torchrun, meanwhile killing hung workers, stopping it (SIGTERM: the workers save) at
    a Slurm job's time limit, and ending it when its rendezvous is lost or a worker exited with bad
    input; (its exit code, ended for bad input)."""
    while True:
        try:
            return proc.wait(timeout=poll_s), False
        except subprocess.TimeoutExpired:
            pass
        kill_hung_workers(exit_dir)
        if limit is not None and (line := limit.check()):
            say(line)
            (exit_dir / contract.SIGNALLED).touch()  # the job's stop (its time limit), not a re-form of the group
            proc.send_signal(signal.SIGTERM)
        lost = watch.check()
        if lost:
            say(lost)
            proc.kill()  # it has no worker left to stop
            proc.wait()
            return EXIT_CRASH, False
        if EXIT_USAGE in recorded(exit_dir):
            # bad input, found before any training: torchrun would retry it as a crash, and a
            # SIGTERM would have it log its shutdown; its workers die with it (PR_SET_PDEATHSIG)
            _say_usage_error(exit_dir)
            proc.kill()
            return proc.wait(), True


def missing_mount() -> str | None:
    """The one-line error for a volume the job was given that is not mounted: TorchX's Slurm and
    local schedulers drop an AppDef's mounts without a word (the folder is then no mount point),
    and the job would write its checkpoints to a folder of the node, which dies with it."""
    for pair in filter(None, os.environ.get(contract.MOUNTS_ENV, "").split(";")):
        dst, _, volume = pair.partition("=")
        if not os.path.ismount(dst):
            return (
                f"error: the volume {volume} was to be mounted at {dst}, and nothing is mounted there: this scheduler "
                f"mounts "
                'nothing (TorchX on Slurm or locally); pass --checkpoint_mount "" --checkpoint_dir DIR (and '
                '--data_mount "" '
                "--data_dir DIR) with folders on storage every node sees"
            )
    return None


def world_range_problem(argv: list[str], cfg: Config | None) -> str | None:
    """The one-line error for a node range (--nnodes MIN:MAX) some of whose sizes do not split the
    global batch: found here, before any node starts, not when a node joins mid-run."""
    from trainer.config import ConfigError, check_world_range

    nnodes = option(argv, "nnodes", "1")
    if cfg is None or ":" not in nnodes:
        return None
    try:
        check_world_range(cfg, nnodes, processes_per_node(argv))
    except ConfigError as e:
        return f"error: {e}"
    return None


def _error_file(message: str) -> None:
    """The torchelastic error file of a launcher that reads it (TorchX shows its message): our one
    line, not the traceback of the SIGTERM that stopped torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            Path(path).write_text(
                json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}})
            )
        except OSError:
            pass


def resumes_from(run_dir: Path | None) -> str:
    """' from step-N', the newest complete checkpoint of the run folder, or ''."""
    found = newest_complete(run_dir) if run_dir is not None else None
    return f" from {found.name}" if found else ""


def native_log(run_dir: Path | None) -> Path:
    """Where torch's native stderr lines go: the run folder's native-stderr.txt (else a temporary
    file, for a module other than the trainer's)."""
    if run_dir is None:
        return Path(tempfile.gettempdir()) / f"trainer-native-stderr-{os.getpid()}.txt"
    return run_dir / "native-stderr.txt"


def torchrun_env(exit_dir: Path, torchrun_args: list[str], cfg: Config | None) -> dict[str, str]:
    """torchrun's environment: the exit folder, the run folder, the node range and the node caches
    beside the user's."""
    # torchrun's restarts would reuse the c10d rendezvous store, whose stale keys from the failed
    # attempt make the new group connect to dead ranks (pytorch issue 167288): a fresh store each time
    env = {
        SHARED_STORE_ENV: "1",
        **os.environ,
        contract.EXIT_DIR_ENV: str(exit_dir),
        contract.NNODES_ENV: option(torchrun_args, "nnodes", "1"),
        **({contract.RUN_DIR_ENV: cfg.checkpoint.dir} if cfg is not None else {}),
        **node_cache_env(cfg),
    }
    if "PYTHONPYCACHEPREFIX" in env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # written under the prefix, on the volume, only
    return env


def conclude(
    code: int, exit_dir: Path, stopped_for_usage: bool, stop: str, limit: slurm.TimeLimit | None, run_dir: Path | None
) -> int:
    """The launcher's exit code once torchrun has ended, and what is said of it. ``stop``: the signal
    (or the time limit) that stopped it, '' if none."""
    codes = recorded(exit_dir)
    final = verdict(code, codes, signalled=bool(stop))
    if final == EXIT_USAGE and not stopped_for_usage:
        _say_usage_error(exit_dir)
    if final == EXIT_USAGE:
        _error_file(_usage_message(exit_dir) or "bad input (exit 2)")
    if slurm.supervising():
        slurm.after(final, limit)
    code = for_launcher(final, run_dir, exit_policy())
    if stop and final == EXIT_PREEMPTED:
        done = "" if codes else " before any worker started: nothing to save"  # the workers said what they saved
        say(f"stopped by {stop}{done}; exit {code} (run the same command to resume{resumes_from(run_dir)})")
    return code


class Forward:
    """Passes a stop signal on to torchrun once (torchrun forwards it to every worker; a repeat would
    only disturb its shutdown); a second Ctrl-C kills it at once."""

    def __init__(self, proc: subprocess.Popen, exit_dir: Path):
        self.proc, self.exit_dir = proc, exit_dir
        self.signals: list[int] = []

    def on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        if self.proc.poll() is not None:
            return
        if signum == signal.SIGINT and self.signals.count(signal.SIGINT) > 1:
            say("second Ctrl-C: stopping at once (the save in progress is lost; earlier checkpoints stay)")
            self.proc.kill()  # the workers follow (PR_SET_PDEATHSIG)
        elif len(self.signals) == 1:
            (self.exit_dir / contract.SIGNALLED).touch()
            say(
                f"{signal.Signals(signum).name} received: the workers stop after their current step and save a "
                f"checkpoint "
                "(Ctrl-C again stops at once)"
            )
            self.proc.send_signal(FORWARDED[signum])


def input_problem(torchrun_args: list[str], cfg: Config | None) -> str | None:
    """The one-line error for input the supervisor can check before torchrun starts, else None."""
    return missing_mount() or slurm.margin_problem() or exit_policy_problem() or world_range_problem(torchrun_args, cfg)


def supervise(torchrun_args: list[str], poll_s: float = 0.5) -> int:
    """Run ``torchrun ARGS`` and return the contract's exit code (see the module docstring)."""
    if warning := slurm.cpu_shortfall():
        say(warning)
    cfg = worker_config(torchrun_args)  # the one parse of the workers' config in this process
    run_dir = cfg.checkpoint.root if cfg is not None else None
    if (error := input_problem(torchrun_args, cfg)) is not None:
        say(error)
        _error_file(error)
        if slurm.supervising():
            slurm.after(EXIT_USAGE, None)
        return EXIT_USAGE
    exit_dir = Path(tempfile.mkdtemp(prefix="trainer-exit-"))
    env = torchrun_env(exit_dir, torchrun_args, cfg)
    torchrun_args = with_rdzv_defaults(torchrun_args)
    cmd = [sys.executable, "-m", "trainer.launch.torchrun", *torchrun_args]  # torchrun itself, with our reporter
    limit = slurm.TimeLimit() if slurm.supervising() else None
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=contract.die_with_parent, stderr=subprocess.PIPE
    )
    relay = Relay(proc.stderr, native_log(run_dir)).start()  # torch's native lines to the run folder, not the console
    got = Forward(proc, exit_dir)
    previous = {s: signal.signal(s, got.on_signal) for s in FORWARDED}
    try:
        code, stopped_for_usage = _watch(proc, exit_dir, LostRendezvous(torchrun_args, proc.pid), limit, poll_s)
        relay.join()  # the workers' last lines before ours
        limited = "the job's time limit" if limit is not None and limit.reached else ""
        stop = signal.Signals(got.signals[0]).name if got.signals else limited
        return conclude(code, exit_dir, stopped_for_usage, stop, limit, run_dir)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(exit_dir, ignore_errors=True)
