"""Typed configuration: nested dataclasses and the rules on their values.

Every field carries a docstring (read them here, or with ``trainer config --explain``). Impossible
values and combinations raise :class:`ConfigError` with a one-line message that names the key and
what it accepts; the CLI turns that into exit code 2 before any process group, data set or
checkpoint is touched. trainer/config_loader.py reads a YAML file and ``key=value`` overrides into
a :class:`Config` (CLI > file > defaults).

``None`` in a ``bool | None`` field means *auto*: on for CUDA GPUs, off on the CPU. Write it as
``auto`` (or ``null``) in YAML and on the command line.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A usage error: bad key, type or value. The message is one line that names the fix."""

    def __str__(self) -> str:
        # raised in a DataLoader worker, it comes back as "Caught ConfigError in DataLoader worker
        # process N." and the worker's traceback: its own line is the last
        text = super().__str__()
        if text.startswith("Caught ConfigError in DataLoader worker") and "ConfigError: " in text:
            return text.rsplit("ConfigError: ", 1)[1].strip()
        return text


Strategy = Literal["auto", "cpu", "single", "dp", "ddp", "fsdp"]


@dataclass
class ModelConfig:
    name: str = "resnet18"
    """Network: one of this project's CIFAR models (resnet18 with the CIFAR stem, seednet: the
    article's 604 M-parameter CNN, airnet: the speed recipe's small net, tinynet: for tests), or any
    torchvision classification model by name (resnet50, convnext_tiny, vit_b_16, ...; untrained,
    built with the data's classes: `trainer models` lists them; torchvision.resnet18 is torchvision's
    ResNet-18, with the ImageNet stem). seednet and tinynet take 32 px only."""
    weights: str = ""
    """Start from pretrained weights ("" = random): a torchvision weights name of model.name (DEFAULT,
    IMAGENET1K_V2, ...: `trainer models` lists each model's; read from $TORCH_HOME/hub/checkpoints,
    downloaded there once per machine where there is a network), or a file: a .pth/.pt state dict,
    a .safetensors file, a step-N folder or run folder of this trainer. The classifier head is
    rebuilt for the data's classes; every other tensor must fit. Images are normalised as the
    weights were trained. A resumed run takes its weights from its checkpoint."""
    freeze_epochs: int = 0
    """With model.weights: the first N epochs train the new head alone (the pretrained layers'
    learning rate is 0; backward still runs through them, so the compiled step and DDP's buckets
    stay the same across the boundary)."""
    compile: bool | None = None
    """torch.compile the model (auto: on for CUDA). Costs tens of seconds before the first step."""
    compile_mode: Literal["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "auto"
    """torch.compile mode. auto: reduce-overhead (CUDA graphs: each compiled graph replays as one
    launch, so the host no longer paces the GPU) for one GPU and ddp, where it measured fastest
    (BENCHMARKS.md); default under fsdp, whose per-layer gathers are not captured in graphs."""
    compile_cache: bool = True
    """Keep torch's compile caches (inductor and Triton) in checkpoint.dir/compile-cache/<key>, keyed
    by torch, GPU, world size and config, so that a restart, on any node, loads the compiled step
    instead of compiling again (what it saves: BENCHMARKS.md, "Restarts"). A new checkpoint.dir
    starts cold. Only used when the model is compiled."""
    channels_last: bool | None = None
    """Keep activations and conv weights in NHWC, what Tensor Cores want (auto: on for CUDA)."""


@dataclass
class DataConfig:
    name: Literal["cifar10", "imagefolder", "shards", "synthetic"] = "cifar10"
    """cifar10 (torchvision, downloaded once per machine), imagefolder (train/ and test/ class folders,
    or their .tar.gz), shards (a folder that `trainer data --shards OUT` wrote: streamed when the set
    does not fit in memory) or synthetic (generated, learnable, offline)."""
    dir: str = "./data"
    """Folder that holds the data set (the container's /data volume)."""
    download: bool = True
    """Download CIFAR-10 when it is not in data.dir (one process per machine; the others wait)."""
    cache_dir: str | None = None
    """Where the decoded uint8 cache goes (default: an image folder's in .data-cache beside the run
    folders, a downloaded set's in data.dir; checkpoint.dir when neither is writable)."""
    train_subset: int = 0
    """Train on this many images drawn at random (0 = all)."""
    test_subset: int = 0
    """Evaluate on this many test images drawn at random (0 = all)."""
    synthetic_train_size: int = 50000
    """Training images of the synthetic set."""
    synthetic_test_size: int = 10000
    """Test images of the synthetic set."""
    image_size: int = 0
    """Side in pixels of the square images the model sees. 0 = auto: 32 for cifar10 and synthetic;
    for images of your own, their median shorter side (from up to 256 of them), at most 224.
    Images of 64 px or less train with CIFAR's recipe (pad and random crop, flip); larger ones with
    torchvision's (random-resized crop 8-100 % of the area, ratio 3/4-4/3, flip; for testing: resize
    to 8/7 of the size, centre crop)."""
    loader: Literal["auto", "memory", "stream"] = "auto"
    """memory: the whole set decoded once into a uint8 cache and held in memory (on the GPU with
    data.device_resident). stream: read from shards step by step, each rank its own images, host
    memory bounded. auto: memory when the decoded set fits in DATA_MEMORY_SHARE of the memory it
    would live in, else stream (shards only). The start line says which, and why."""
    decode: Literal["auto", "gpu", "cpu"] = "auto"
    """Streamed JPEGs: decoded by the DataLoader workers on the CPU (cropped and resized there), or
    on the GPU in batches (nvjpeg and one batched crop, read ahead on a thread; the workers only
    read bytes). auto: cpu, faster where measured (BENCHMARKS.md, "Your own images: ResNet-50 at
    224 px from shards")."""
    max_bad_images: int = 100
    """Streamed images that fail to decode (a damaged shard) are skipped: a copy of another image of
    the same batch takes the place, and a line names the shard. Past this many on one rank the run
    stops (exit 2) and names the shard to rebuild."""
    crop_padding: int = 4
    """Random-crop padding in pixels for training (0 turns the crop off)."""
    crop_mode: Literal["zeros", "reflect"] = "zeros"
    """How the random crop fills the border: zero padding or a mirror of the image."""
    flip: bool = True
    """Horizontal flips for training."""
    flip_mode: Literal["random", "alternate"] = "random"
    """random: each image is mirrored with probability 1/2 in every epoch. alternate: a fixed random
    half of the images is mirrored in even epochs and the other half in odd ones, so each image is
    seen both ways in turn (airbench's alternating flip; helps short runs)."""
    device_resident: bool = True
    """Keep the whole uint8 data set in device memory (the GPU's, or the CPU's) and gather each
    batch there: no per-step host work. Off: a DataLoader with DistributedSampler, workers and
    pinned memory feeds each step (the same batches; for data that does not fit)."""
    num_workers: int = 2
    """DataLoader workers when data.device_resident is off."""
    stream_workers: int = 0
    """DataLoader workers of a streamed set, per process. 0 = auto: 4 when the GPU decodes (the
    workers only read bytes), else this process's share of the node's cores, at most 16."""
    eval_batch_size: int = 1000
    """Test images per process per evaluation step."""


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    """Optimizer."""
    lr: float = 0.2
    """Peak learning rate for the global batch."""
    momentum: float = 0.9
    """SGD momentum (beta1 for AdamW)."""
    nesterov: bool = True
    """Nesterov momentum (SGD)."""
    weight_decay: float = 5e-4
    """L2 weight decay."""
    schedule: Literal["cosine", "triangle", "constant"] = "cosine"
    """Learning-rate schedule over all steps of all epochs: linear warm-up, then cosine or linear
    decay to optim.final_lr_fraction; or constant."""
    warmup_epochs: float = 1.0
    """Linear warm-up length in epochs (cosine, triangle)."""
    warmup_start: float = 0.0
    """Learning rate at step 0, as a fraction of optim.lr."""
    final_lr_fraction: float = 0.0
    """Learning rate at the last step, as a fraction of optim.lr."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    bias_lr_scale: float = 1.0
    """Learning-rate multiplier for biases and norm parameters (no weight decay on them)."""
    impl: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """Optimizer kernels: fused (one kernel, CUDA), foreach (batched) or a plain loop (auto: fused
    on CUDA, foreach on the CPU)."""
    backbone_lr_scale: float = 1.0
    """With model.weights: learning-rate multiplier for the pretrained layers (the new head learns
    at optim.lr). Fine-tuning uses 0.1 or so: the pretrained features move less than the head."""
    lookahead_every: int = 0
    """Lookahead: every N steps pull the weights towards a slow copy (0 = off)."""


@dataclass
class TrainConfig:
    strategy: Strategy = "auto"
    """auto (ddp under torchrun, else one GPU, else the CPU), cpu, single (one GPU), dp
    (DataParallel over the visible GPUs: easy and slow), ddp (DistributedDataParallel under
    torchrun), fsdp (sharded data parallel under torchrun: gradients and optimizer state split
    across ranks)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where ddp/fsdp processes compute (auto: CUDA when visible)."""
    epochs: int = 30
    """Passes over the training set."""
    batch_size: int = 512
    """Global batch: split evenly across processes (must be a multiple of the world size)."""
    seed: int = 0
    """Seed of the model's initialisation, the epoch order and the augmentation."""
    deterministic: bool = False
    """Deterministic kernels (bit-identical reruns; slower on GPUs)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16 autocast or plain fp32 (auto: bf16 on CUDA)."""
    param_dtype: Literal["auto", "fp32", "bf16"] = "fp32"
    """Dtype of the weight matrices that forward and backward use. bf16 (needs bf16 autocast; SGD
    without Lookahead; one GPU or ddp): the optimizer keeps an fp32 master copy of each and writes
    the bf16 copy after every step, so gradients come out, and are all-reduced, in bf16 (half the
    bytes of fp32) and autocast casts no weights per step. Biases and norm parameters stay fp32.
    Checkpoints hold the fp32 master weights either way. auto: bf16 wherever it works (so fp32 on
    the CPU, whose autocast is off by default). Its gain: BENCHMARKS.md, "What each optimisation bought"."""
    log_every: int = 50
    """Steps between log lines: each one is a CPU-GPU sync point."""
    log_seconds: float = 30.0
    """Also a log line once this many seconds have passed since the last one (0 = steps only), so
    that slow steps (a big model on a CPU) still show progress."""
    max_steps: int = 0
    """Stop after this many steps in all (0 = run every epoch); for benchmarks and smoke runs."""
    eval_every: int = 1
    """Epochs between test evaluations (the last epoch is always evaluated)."""
    tta: Literal["none", "flip", "flip_translate"] = "none"
    """Test-time augmentation: average the logits of the image and its mirror (flip), and also of
    copies shifted by one pixel (flip_translate)."""
    plot: bool = True
    """Write curves.png (loss and accuracy) at the end."""
    tensorboard: bool = True
    """TensorBoard scalars (loss, accuracy, lr, images/s, step time) in checkpoint.dir/tensorboard,
    from rank 0, when the tensorboard package is installed (pip install 'cluster-trainer[tensorboard]');
    silently off without it. A resumed run continues the same curves."""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend (auto: nccl on CUDA, gloo on the CPU)."""
    timeout_s: int = 300
    """Seconds a collective may wait for a silent rank before the job fails (and torchrun restarts)."""
    hang_timeout_s: float = 180.0
    """Seconds without progress (a finished training step, evaluation batch or checkpoint save)
    after which a worker writes its Python stacks to <run folder>/hang-rank<R>.txt and exits as a
    crash (124), so the launcher restarts from the newest checkpoint: a blocked read or write, a
    deadlock, a stopped process, also with one process where no collective times out. Raised to 10x
    the longest ordinary pause seen so far in the run (a stall the run recovered from does not
    count); with several processes never past 0.9 x dist.timeout_s, so a hang leaves stacks
    before the collective timeout fires; armed after the first step (compilation is not
    watched); 0 turns it off."""
    bucket_mb: int = 25
    """DDP gradient bucket size in MB."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients live in the communication buckets (saves a copy of every gradient)."""
    static_graph: bool = False
    """DDP: the graph is the same every step (lets DDP skip per-step bookkeeping)."""
    comm_hook: Literal["none", "bf16", "fp16"] = "none"
    """DDP: compress gradients to 16 bits for the all-reduce."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """fsdp: precision of the gradient reduce-scatter."""
    split_graph_at_buckets: bool | None = None
    """Compiled DDP: split the compiled graph at gradient-bucket boundaries, so buckets are
    all-reduced while backward runs (true), or compile one graph and all-reduce after it (false:
    fewer graph launches per step, for small models whose step is bound by launch overhead).
    auto: split when the gradients fill more than SPLIT_BUCKETS buckets (seednet's 2.4 GB), not for
    ResNet-18's 45 MB, whose all-reduce takes a fraction of a millisecond after backward, and not
    for one process (nothing to overlap)."""
    gather_linear_factors: bool | None = None
    """ddp: a Linear layer's weight gradient is a sum over the batch of (output gradient) x (input)
    products, so every rank can all-gather the layer's inputs and output gradients ((in + out) x
    batch values) and form the summed gradient itself, instead of all-reducing it (in x out
    values). It costs a graph break and the other ranks' share of the weight-gradient product.
    auto: on for the layers where it sends FACTOR_RATIO (16) times fewer values, as seednet's first
    Linear at batch 64 per GPU (where it gains and where it loses: BENCHMARKS.md, "What each
    optimisation bought"). The same gradient up to rounding."""
    broadcast_buffers: bool = False
    """DDP: copy rank 0's buffers (batch-norm statistics) to every rank before each forward, as
    DDP itself does by default. Off here: it saves a broadcast and its host work per step. Running
    statistics are not used in training (batch norm uses the batch's); evaluations and checkpoints
    use rank 0's (copied to every rank before each evaluation), so rank 0's run is the same either way."""


@dataclass
class CheckpointConfig:
    dir: str = "./checkpoints"
    """Run folder: step-N checkpoints, config.yaml, metrics.jsonl and curves.png (rank 0 writes)."""

    @property
    def root(self) -> Path:
        """The run folder as a path: what every part of the run takes (not a key of the config)."""
        return Path(self.dir)

    every_epochs: int = 1
    """Save after every N epochs (0 = only at the end)."""
    every_steps: int = 0
    """Also save every N steps inside an epoch (0 = off); resumes mid-epoch."""
    keep: int = 3
    """Keep the newest K complete checkpoints."""
    resume: str = "auto"
    """auto (newest complete checkpoint in checkpoint.dir, if any), never, or a checkpoint path."""
    async_save: bool | None = None
    """Copy the state to pinned host memory and write it in the background (auto: on for CUDA)."""


@dataclass
class ProfileConfig:
    steps: int = 0
    """Record this many training steps with torch.profiler (0 = off). Each rank writes
    profile-rankR.json (a trace for https://ui.perfetto.dev or chrome://tracing) and profile-rankR.txt
    (the ops with the most host and GPU time) to the run folder; metrics.jsonl gets a summary
    (wall and device-busy time per step, host waits on the GPU). Two sync points, around the window."""
    skip: int = 20
    """Steps of this launch before the profiled window (compilation and warm-up are over by then)."""


POSITIVE = (
    "train.epochs train.batch_size train.log_every train.eval_every optim.lr data.eval_batch_size dist.timeout_s "
    "dist.bucket_mb "
    "checkpoint.keep data.synthetic_train_size data.synthetic_test_size"
).split()
NON_NEGATIVE = (
    "train.max_steps optim.weight_decay optim.momentum optim.warmup_epochs optim.final_lr_fraction optim.warmup_start "
    "optim.label_smoothing optim.bias_lr_scale optim.backbone_lr_scale model.freeze_epochs optim.lookahead_every "
    "data.train_subset data.test_subset data.crop_padding "
    "data.num_workers data.stream_workers data.image_size data.max_bad_images checkpoint.every_epochs "
    "checkpoint.every_steps train.seed profile.steps profile.skip dist.hang_timeout_s"
).split()


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def get(self, key: str) -> Any:
        """A value by its dotted key (``train.epochs``)."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def validate(self) -> Config:
        """Raise ConfigError on the first impossible value; return self."""
        for key in POSITIVE:
            if (value := self.get(key)) <= 0:
                raise ConfigError(f"{key}={value} must be greater than 0")
        for key in NON_NEGATIVE:
            if (value := self.get(key)) < 0:
                raise ConfigError(f"{key}={value} must not be negative")
        if self.optim.momentum >= 1:
            raise ConfigError(f"optim.momentum={self.optim.momentum} must be below 1")
        if self.optim.label_smoothing >= 1:
            raise ConfigError(f"optim.label_smoothing={self.optim.label_smoothing} must be below 1")
        if not self.checkpoint.dir:
            raise ConfigError("checkpoint.dir must not be empty")
        if self.model.freeze_epochs and not self.model.weights:
            raise ConfigError(
                "model.freeze_epochs needs model.weights (a pretrained start to freeze); set model.weights or "
                "model.freeze_epochs=0"
            )
        if problem := model_name_problem(self.model.name):
            raise ConfigError(problem)
        if problem := self.combination_problem():
            raise ConfigError(problem)
        return self

    def combination_rules(self, strategy: str | None = None, cuda: bool | None = None) -> list[tuple[bool, str]]:
        """Every rule about values that cannot work together: (broken, the one-line error naming the
        fix). validate() asks with the config as given (``trainer check``, ``trainer launch``, every
        worker), check_devices() with this node's GPUs, a worker again with ``strategy`` and ``cuda``
        as this node resolved them (what auto left open)."""
        t = self.train
        strategy = strategy or t.strategy
        cpu = cuda is False or "cpu" in (strategy, t.device)
        no_bf16 = t.precision == "fp32" or (t.precision == "auto" and cpu)
        return [*self._strategy_rules(strategy), *self._device_rules(cpu, no_bf16, strategy)]

    def _strategy_rules(self, strategy: str) -> list[tuple[bool, str]]:
        """What does not work together with the strategy (or at all)."""
        o = self.optim
        return [
            (
                o.nesterov and o.momentum == 0 and o.name == "sgd",
                "optim.nesterov=true needs optim.momentum > 0; set optim.nesterov=false",
            ),
            (
                self.model.compile and strategy == "dp",
                "model.compile=true does not work with train.strategy=dp; use model.compile=false (or auto) or "
                "train.strategy=ddp",
            ),
            (
                o.lookahead_every and strategy == "fsdp",
                "optim.lookahead_every (Lookahead) does not work with train.strategy=fsdp; set "
                "optim.lookahead_every=0 or use ddp",
            ),
            (
                o.impl == "fused" and strategy == "fsdp",
                "optim.impl=fused does not run on fsdp's sharded parameters; use optim.impl=foreach (or auto)",
            ),
        ]

    def _device_rules(self, cpu: bool, no_bf16: bool, strategy: str) -> list[tuple[bool, str]]:
        """What needs a GPU, or bf16, that this run does not have."""
        t, o = self.train, self.optim
        return [
            (o.impl == "fused" and cpu, "optim.impl=fused needs CUDA; use optim.impl=foreach (or auto) on the CPU"),
            (
                self.dist.backend == "nccl" and strategy in ("cpu", "single", "dp"),
                f"dist.backend=nccl needs train.strategy=ddp or fsdp under torchrun, not {strategy}",
            ),
            (
                self.dist.backend == "nccl" and cpu,
                "dist.backend=nccl needs CUDA GPUs and this run is on the CPU; use dist.backend=gloo (or auto)",
            ),
            (
                self.data.decode == "gpu" and cpu,
                "data.decode=gpu needs a CUDA GPU and this run is on the CPU; use data.decode=cpu (or auto)",
            ),
            (
                t.param_dtype == "bf16" and no_bf16,
                "train.param_dtype=bf16 needs bf16 autocast; set train.precision=bf16 (or auto on a GPU), or "
                "train.param_dtype=fp32",
            ),
            *[(t.param_dtype == "bf16" and bad, message) for bad, message in self._bf16_weights_rules(strategy)],
        ]

    def combination_problem(self, strategy: str | None = None, cuda: bool | None = None) -> str | None:
        """The first broken rule's error (see :meth:`combination_rules`), or None."""
        return next((message for bad, message in self.combination_rules(strategy, cuda) if bad), None)

    def bf16_weights_problem(self, strategy: str) -> str | None:
        """Why bf16 working weights cannot work with this config under ``strategy``, or None.
        train.param_dtype=bf16 raises it (a rule of :meth:`combination_rules`); auto falls back to fp32."""
        return next((message for bad, message in self._bf16_weights_rules(strategy) if bad), None)

    def _bf16_weights_rules(self, strategy: str) -> list[tuple[bool, str]]:
        hint = (
            "fsdp gathers bf16 weights itself (dist.reduce_dtype)"
            if strategy == "fsdp"
            else "DataParallel replicates the module every step"
        )
        return [
            (
                strategy in ("fsdp", "dp"),
                f"train.param_dtype=bf16 does not work with train.strategy={strategy} ({hint}); set "
                f"train.param_dtype=fp32 or use ddp",
            ),
            (
                self.optim.name != "sgd",
                "train.param_dtype=bf16 updates its fp32 master weights with SGD only; set optim.name=sgd or "
                "train.param_dtype=fp32",
            ),
            (
                bool(self.optim.lookahead_every),
                "train.param_dtype=bf16 does not work with Lookahead (optim.lookahead_every); set "
                "optim.lookahead_every=0 or train.param_dtype=fp32",
            ),
        ]


CIFAR_MODELS = ("resnet18", "seednet", "airnet", "tinynet")
"""This project's own networks (trainer/worker/models.py); every other model.name is torchvision's."""


TORCHVISION_MODELS = (
    "alexnet",
    "convnext_base",
    "convnext_large",
    "convnext_small",
    "convnext_tiny",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "efficientnet_b0",
    "efficientnet_b1",
    "efficientnet_b2",
    "efficientnet_b3",
    "efficientnet_b4",
    "efficientnet_b5",
    "efficientnet_b6",
    "efficientnet_b7",
    "efficientnet_v2_l",
    "efficientnet_v2_m",
    "efficientnet_v2_s",
    "googlenet",
    "inception_v3",
    "maxvit_t",
    "mnasnet0_5",
    "mnasnet0_75",
    "mnasnet1_0",
    "mnasnet1_3",
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "regnet_x_16gf",
    "regnet_x_1_6gf",
    "regnet_x_32gf",
    "regnet_x_3_2gf",
    "regnet_x_400mf",
    "regnet_x_800mf",
    "regnet_x_8gf",
    "regnet_y_128gf",
    "regnet_y_16gf",
    "regnet_y_1_6gf",
    "regnet_y_32gf",
    "regnet_y_3_2gf",
    "regnet_y_400mf",
    "regnet_y_800mf",
    "regnet_y_8gf",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnext101_32x8d",
    "resnext101_64x4d",
    "resnext50_32x4d",
    "shufflenet_v2_x0_5",
    "shufflenet_v2_x1_0",
    "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0",
    "squeezenet1_0",
    "squeezenet1_1",
    "swin_b",
    "swin_s",
    "swin_t",
    "swin_v2_b",
    "swin_v2_s",
    "swin_v2_t",
    "vgg11",
    "vgg11_bn",
    "vgg13",
    "vgg13_bn",
    "vgg16",
    "vgg16_bn",
    "vgg19",
    "vgg19_bn",
    "vit_b_16",
    "vit_b_32",
    "vit_h_14",
    "vit_l_16",
    "vit_l_32",
    "wide_resnet101_2",
    "wide_resnet50_2",
)
"""torchvision's classification models (0.29; tests/test_config.py holds it equal to the installed
torchvision's list): `trainer config --explain` and the config check need no torch import. A name
missing here is looked up in the installed torchvision before it is refused."""


def torchvision_names() -> list[str]:
    """torchvision's classification models (importing torchvision: a second or two, so only asked
    for a name that is not one of CIFAR_MODELS)."""
    import torchvision.models

    return sorted(torchvision.models.list_models(module=torchvision.models))


def model_name_problem(name: str) -> str | None:
    """Why model.name names no model, or None. ``torchvision.NAME`` names torchvision's model where
    this project has one of the same name (torchvision.resnet18: the ImageNet stem)."""
    if name in CIFAR_MODELS or name.removeprefix("torchvision.") in TORCHVISION_MODELS:
        return None
    if name.removeprefix("torchvision.") in torchvision_names():  # a newer torchvision's
        return None
    choices = [*CIFAR_MODELS, *torchvision_names()]
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"model.name={name} is no model here; {hint}`trainer models` lists them "
        "(this project's CIFAR models and torchvision's)"
    )


def check_devices(cfg: Config, has_cuda: bool) -> None:
    """What the config asks of the hardware, whatever the launcher: CUDA where it is named, NCCL
    only with CUDA. Raises ConfigError naming the fix."""
    t = cfg.train
    if t.strategy in ("single", "dp") and not has_cuda:
        # a launcher that chose the strategy names its own fix (TorchX: --gpu 0)
        fix = os.environ.get("TRAINER_NO_GPU_FIX") or "use train.strategy=cpu (or auto)"
        raise ConfigError(f"train.strategy={t.strategy} needs a CUDA GPU and none is visible; {fix}")
    if t.device == "cuda" and not has_cuda:
        raise ConfigError("train.device=cuda but no CUDA GPU is visible; use train.device=cpu (or auto)")
    if problem := cfg.combination_problem(cuda=has_cuda):  # the rules with what auto becomes on this node
        raise ConfigError(problem)


def check_batch(cfg: Config, world_size: int) -> None:
    """The global batch splits evenly over the processes."""
    b, w = cfg.train.batch_size, world_size
    if b < w:
        raise ConfigError(f"train.batch_size={b} is smaller than the world size {w}; use at least {w}")
    if b % w:
        raise ConfigError(
            f"train.batch_size={b} is not a multiple of the world size {w}; use {b - b % w} or {b + w - b % w}"
        )


def node_range(nnodes: str) -> tuple[int, int]:
    """torchrun's --nnodes N or MIN:MAX as (MIN, MAX); raises ConfigError naming the fix."""
    lo, sep, hi = str(nnodes).partition(":")
    hi = hi if sep else lo
    if not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
        raise ConfigError(f"--nnodes={nnodes} must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 2:4)")
    return int(lo), int(hi)


def check_world_range(cfg: Config, nnodes: str, nproc_per_node: int) -> None:
    """Every world size an elastic job may take (each node count in MIN..MAX times the processes
    per node) splits the global batch evenly: refused at launch, never found when a node joins."""
    lo, hi = node_range(nnodes)
    if lo == hi:
        check_batch(cfg, lo * nproc_per_node)
        return
    sizes = [n * nproc_per_node for n in range(lo, hi + 1)]
    b = cfg.train.batch_size
    bad = [w for w in sizes if b < w or b % w]
    if bad:
        lcm = math.lcm(*sizes)
        fit = max(lcm, round(b / lcm) * lcm)
        raise ConfigError(
            f"train.batch_size={b} does not split over {bad[0] // nproc_per_node} node(s) x {nproc_per_node} "
            f"process(es) "
            f"(--nnodes {nnodes}): every size the elastic job may take ({', '.join(map(str, sizes))} processes) must "
            f"divide it; use train.batch_size={fit} or a node range whose sizes all divide {b}"
        )
