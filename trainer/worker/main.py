"""The worker's entry: what ``trainer train`` runs in each training process."""

from __future__ import annotations

from trainer.config import Config, ConfigError
from trainer.contract import EXIT_CRASH, record_exit, record_start, say
from trainer.worker import crash
from trainer.worker.loop import Trainer
from trainer.worker.run import build
from trainer.worker.runtime import gather_hosts, setup, teardown


def train(cfg: Config, started: float) -> int:
    """Train as one worker (alone, or one rank of torchrun's group) and return the contract's code:
    set up the process group, build the run, fit, tear down. A crash is one line on the console
    (once per node for a lost peer) and its traceback in the run folder; bad input goes up as the
    ConfigError the CLI prints."""
    rt = setup(cfg)
    record_start()  # a group killed before its workers record an exit is not taken for the one before it
    run, hosts, line = None, [], ""
    try:
        hosts, rt = gather_hosts(rt)  # rank -> host and addresses, to name a peer that is lost later, or slow
        run = build(cfg, rt, started)
        run.hosts = hosts
        try:
            code = Trainer(run).fit()
        finally:
            run.watchdog.close()
            run.checkpointer.close()
            run.metrics.close()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a crash: one line here, the traceback in the run folder
        line = crash.report(
            e,
            cfg.checkpoint.root,
            rt.rank,
            run.state.step if run else None,
            hosts,
            cfg.dist.timeout_s,
            run.watchdog.peers if run else None,
        )
        if rt.local_rank == 0 or not crash.LOST.search(str(e)):  # a lost peer: once per node
            say(line)
        code = EXIT_CRASH
    finally:
        teardown()
    record_exit(code, line)
    return code
