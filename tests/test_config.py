from __future__ import annotations

import os

import pytest
import yaml
from conftest import ROOT, run, trainer_cmd, tree_files

from trainer.cli import strip_local_rank
from trainer.config import Config, ConfigError
from trainer.config_loader import explain, from_dict, load_config, to_dict, to_yaml, valid_keys


def test_default_yaml_mirrors_the_code_defaults():
    assert to_dict(load_config(ROOT / "configs" / "default.yaml")) == to_dict(Config())


@pytest.mark.parametrize("name", ["default", "seed", "smoke", "fast", "images"])
def test_shipped_configs_open_with_launch_commands_that_resolve(name):
    """Each config file opens with the commands that train it; every such command's config file
    and overrides resolve (no unknown key, no wrong type), as `trainer train` would resolve them."""
    path = ROOT / "configs" / f"{name}.yaml"
    load_config(path)
    commands = [
        line.lstrip("# ").split("#")[0].split()
        for line in path.read_text().splitlines()[:8]
        if line.startswith("#") and (" -m trainer train " in line or "make run-local" in line)
    ]
    assert commands, f"{path.name} shows no launch command in its header"
    for words in commands:
        if words[:2] == ["make", "run-local"]:
            assert name == "default"  # run-local's CONFIG defaults to configs/default.yaml (Makefile)
            continue
        args = words[words.index("train", words.index("trainer")) + 1 :]
        assert args[args.index("--config") + 1] == f"configs/{name}.yaml", words
        overrides = [a for a in args if "=" in a]
        cfg = load_config(ROOT / args[args.index("--config") + 1], overrides)
        for o in overrides:  # the override took effect
            section, key = o.split("=")[0].split(".")
            assert str(getattr(getattr(cfg, section), key)) == o.split("=", 1)[1], o


def test_seed_config_is_the_articles_setup():
    cfg = load_config(ROOT / "configs" / "seed.yaml")
    assert (cfg.model.name, cfg.train.batch_size, cfg.optim.name, cfg.optim.lr, cfg.train.epochs) == (
        "seednet",
        64,
        "sgd",
        0.01,
        10,
    )
    assert cfg.optim.momentum == 0 and cfg.optim.schedule == "constant"


def test_precedence_cli_over_file_over_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 7\n  batch_size: 128\n")
    cfg = load_config(f, ["train.epochs=9"])
    assert cfg.train.epochs == 9  # CLI beats file
    assert cfg.train.batch_size == 128  # file beats default
    assert cfg.optim.lr == Config().optim.lr  # default


def test_auto_and_types_are_coerced():
    cfg = load_config(
        None, ["model.compile=auto", "optim.lr=1", "data.device_resident=false", "checkpoint.resume=/x/step-3"]
    )
    assert cfg.model.compile is None and cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.data.device_resident is False and cfg.checkpoint.resume == "/x/step-3"


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.bath_size=3", ["train.bath_size", "did you mean train.batch_size"]),
        ("trian.epochs=3", ["trian.epochs", "train.epochs"]),
        ("train.epochs=three", ["train.epochs", "an integer"]),
        ("train.epochs=2.5", ["train.epochs", "an integer"]),
        ("train.deterministic=maybe", ["train.deterministic", "true or false"]),
        ("train.strategy=fast", ["train.strategy", "auto, cpu, single, dp, ddp, fsdp"]),
        ("model.name=vgg", ["model.name=vgg", "did you mean vgg19", "trainer models"]),
        ("train.batch_size=0", ["train.batch_size=0", "greater than 0"]),
        ("optim.lr=-0.1", ["optim.lr", "greater than 0"]),
        ("optim.weight_decay=-1", ["optim.weight_decay", "not be negative"]),
        ("optim.momentum=1.5", ["optim.momentum", "below 1"]),
        ("train", ["train", "key=value"]),
        ("train=3", ["names a section", "train."]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_bad_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    f.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match="did you mean train.epochs"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_round_trip_through_dict_and_yaml():
    cfg = load_config(None, ["train.epochs=3", "model.compile=true", "data.cache_dir=/tmp/c"])
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    assert to_dict(from_dict(yaml.safe_load(to_yaml(cfg)))) == to_dict(cfg)


def test_a_renamed_key_still_loads_with_one_warning_line(tmp_path):
    """optim.ema_every is optim.lookahead_every now: a file, an override and a checkpoint's saved
    config with the old name keep their meaning; the command says once to rename it."""
    old = tmp_path / "old.yaml"
    old.write_text("optim:\n  ema_every: 5\n")
    assert load_config(old).optim.lookahead_every == 5
    assert load_config(None, ["optim.ema_every=3"]).optim.lookahead_every == 3
    assert from_dict({"optim": {"ema_every": 4}}).optim.lookahead_every == 4
    p = run(trainer_cmd("config", "--config", str(old), "optim.ema_every=7"))
    assert "lookahead_every: 7" in p.stdout and "ema_every" not in p.stdout
    warnings = [line for line in p.stderr.splitlines() if "ema_every" in line]
    assert warnings == [
        "warning: config key optim.ema_every is now optim.lookahead_every; the old name still works, rename it"
    ]


def test_explain_documents_every_key():
    text = explain()
    for key in valid_keys():
        assert key in text
    assert "Global batch" in text  # a field docstring made it through


def test_legacy_local_rank_argument_is_accepted(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank(["--local_rank=1", "train", "x=1"]) == ["train", "x=1"]
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank(["train", "--local-rank", "3"]) == ["train"]
    assert os.environ["LOCAL_RANK"] == "3"


@pytest.mark.parametrize("override", ["train.batch_size=0", "train.bath_size=3", "optim.lr=-1", "model.name=vggx"])
def test_cli_exits_2_with_one_line_and_writes_nothing(tmp_path, override):
    ck = tmp_path / "ck"
    p = run(trainer_cmd("train", f"checkpoint.dir={ck}", override), check=False)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and override.split("=")[0] in lines[0]
    assert "Traceback" not in p.stderr
    assert tree_files(ck) == {}


def test_config_command_prints_the_resolved_config():
    p = run(trainer_cmd("config", "--config", "configs/smoke.yaml", "train.epochs=5"))
    tree = yaml.safe_load(p.stdout)
    assert tree["train"]["epochs"] == 5 and tree["model"]["name"] == "tinynet"


def test_every_size_of_an_elastic_range_must_split_the_batch():
    from trainer.config import check_world_range

    cfg = load_config(None, ["train.batch_size=64"])
    check_world_range(cfg, "2", 8)
    with pytest.raises(
        ConfigError, match=r"3 node\(s\) x 8 process\(es\) \(--nnodes 2:4\).*16, 24, 32 processes.*train.batch_size=96"
    ):
        check_world_range(cfg, "2:4", 8)  # 24 processes do not split 64
    with pytest.raises(ConfigError) as e:
        check_world_range(load_config(None, ["train.batch_size=64"]), "2:3", 1)
    assert (
        "\n" not in str(e.value)
        and "3 node(s) x 1 process(es) (--nnodes 2:3)" in str(e.value)
        and "train.batch_size=66" in str(e.value)
    )
    check_world_range(load_config(None, ["train.batch_size=96"]), "2:3", 1)
    check_world_range(load_config(None, ["train.batch_size=96"]), "4", 8)
    for bad in ("0:2", "3:2", "two", "2:"):
        with pytest.raises(ConfigError, match="MIN:MAX"):
            check_world_range(cfg, bad, 1)


def test_trainer_check_refuses_a_range_in_one_line():
    p = run(
        trainer_cmd("check", "--config", "configs/smoke.yaml", "--nnodes", "2:3", "train.batch_size=64"), check=False
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "every size the elastic job may take" in p.stderr, (
        p.stderr
    )
    ok = run(
        trainer_cmd(
            "check", "--config", "configs/smoke.yaml", "--nnodes", "2:3", "train.batch_size=96", "data.name=synthetic"
        ),
        check=False,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr


# Every rule about values that cannot work together, with overrides that break it on any machine
# (a CPU-only node included), and words of its error.
COMBINATIONS = {
    "nesterov without momentum": (
        ["optim.momentum=0", "optim.nesterov=true"],
        "optim.nesterov=true needs optim.momentum > 0",
    ),
    "compile with dp": (
        ["model.compile=true", "train.strategy=dp"],
        "model.compile=true does not work with train.strategy=dp",
    ),
    "lookahead with fsdp": (
        ["train.strategy=fsdp", "optim.lookahead_every=5"],
        "optim.lookahead_every (Lookahead) does not work with train.strategy=fsdp",
    ),
    "fused with fsdp": (
        ["train.strategy=fsdp", "optim.impl=fused"],
        "optim.impl=fused does not run on fsdp's sharded parameters",
    ),
    "fused on the cpu": (["train.strategy=cpu", "optim.impl=fused"], "optim.impl=fused needs CUDA"),
    "gpu decode on the cpu": (
        ["train.strategy=cpu", "data.decode=gpu"],
        "data.decode=gpu needs a CUDA GPU and this run is on the CPU",
    ),
    "nccl in one process": (
        ["train.strategy=single", "dist.backend=nccl"],
        "dist.backend=nccl needs train.strategy=ddp or fsdp under torchrun",
    ),
    "nccl on the cpu": (["train.device=cpu", "dist.backend=nccl"], "dist.backend=nccl needs CUDA GPUs"),
    "bf16 weights without autocast": (
        ["train.precision=fp32", "train.param_dtype=bf16"],
        "train.param_dtype=bf16 needs bf16 autocast",
    ),
    "bf16 weights with fsdp": (
        ["train.precision=bf16", "train.param_dtype=bf16", "train.strategy=fsdp"],
        "train.param_dtype=bf16 does not work with train.strategy=",
    ),
    "bf16 weights with adamw": (
        ["train.precision=bf16", "train.param_dtype=bf16", "optim.name=adamw"],
        "master weights with SGD only",
    ),
    "bf16 weights with lookahead": (
        ["train.precision=bf16", "train.param_dtype=bf16", "optim.lookahead_every=4"],
        "does not work with Lookahead",
    ),
}


def test_every_combination_rule_has_a_case_here():
    """A rule added to Config.combination_rules without a case in COMBINATIONS fails here."""
    missing = [m for _, m in Config().combination_rules() if not any(words in m for _, words in COMBINATIONS.values())]
    assert not missing, missing


def unvalidated(overrides: list[str]) -> Config:
    """The config with these overrides and no validation: what a worker holds if its launcher never checked."""
    cfg = Config()
    for key, value in (o.split("=", 1) for o in overrides):
        section, name = key.split(".")
        setattr(
            getattr(cfg, section),
            name,
            {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value),
        )
    return cfg


@pytest.mark.parametrize("case", COMBINATIONS)
def test_trainer_check_refuses_what_a_worker_would(case):
    """`trainer check` (what launchers run first) stops on each rule with its one line and exit 2;
    a worker on a node with or without GPUs finds the same with auto resolved there."""
    overrides, words = COMBINATIONS[case]
    p = run(trainer_cmd("check", "--config", "configs/smoke.yaml", *overrides), check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and words in p.stderr, p.stderr
    cfg = unvalidated(overrides)
    strategy = cfg.train.strategy if cfg.train.strategy != "auto" else "ddp"  # auto under torchrun
    for cuda in (False, True):
        assert words in (cfg.combination_problem(strategy, cuda) or ""), (cuda, cfg.combination_problem(strategy, cuda))


def test_trainer_launch_stops_on_a_rule_before_torchrun_starts(tmp_path):
    p = run(
        trainer_cmd(
            "launch",
            "--nproc-per-node",
            "2",
            "--config",
            "configs/smoke.yaml",
            "train.strategy=fsdp",
            "optim.lookahead_every=5",
            f"checkpoint.dir={tmp_path / 'ck'}",
        ),
        check=False,
        timeout=60,
    )
    assert p.returncode == 2 and "torchrun" not in p.stderr and "does not work with train.strategy=fsdp" in p.stderr, (
        p.stderr
    )
    assert not (tmp_path / "ck").exists()


def test_the_torchvision_model_list_is_the_installed_torchvisions():
    from trainer.config import TORCHVISION_MODELS, torchvision_names

    assert list(TORCHVISION_MODELS) == torchvision_names(), (
        "torchvision's models changed: update TORCHVISION_MODELS in trainer/config.py"
    )


def test_a_number_in_e_notation_without_a_dot_is_a_number():
    """YAML 1.1 reads 5e-4 as text; a float key takes it, and refuses text that is no finite number."""
    assert load_config(None, ["optim.weight_decay=5e-4"]).optim.weight_decay == 0.0005
    for bad in ("optim.lr=fast", "optim.lr=nan", "optim.lr=inf"):
        with pytest.raises(ConfigError, match="expected a number"):
            load_config(None, [bad])
