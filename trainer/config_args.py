"""The one grammar of a config on a command line: ``--config FILE`` and the ``KEY=VALUE`` overrides
after it. The CLI's commands (trainer/cli.py) take their arguments with it, and the supervisor reads
the workers' config with it (:func:`command_config`). Apart from config_loader, which the tools venv
(k8s/render.py) imports with yaml alone, no click.
"""

from __future__ import annotations

import click

from trainer.config import Config, ConfigError
from trainer.config_loader import load_config


def config_arguments(fn):
    """``--config FILE`` and the ``KEY=VALUE`` overrides after it: the one grammar of a config on a
    command line, the CLI's commands' (trainer/cli.py) and :func:`command_config`'s."""
    fn = click.argument("overrides", nargs=-1)(fn)
    return click.option("--config", "-c", "config_file", metavar="FILE", help="YAML config (configs/*.yaml).")(fn)


@click.command(add_help_option=False)
@config_arguments
def _config_only(config_file, overrides):
    """The arguments of ``trainer train``, parsed, nothing run."""


def command_config(args: list[str]) -> Config | None:
    """The config of ``python -m trainer train ARGS`` (``args``: the part after ``train``), parsed as
    the CLI parses it; None for bad input, which the workers report in their own words."""
    try:
        ctx = _config_only.make_context("train", list(args))
        return load_config(ctx.params["config_file"], ctx.params["overrides"])
    except (click.ClickException, ConfigError):
        return None
