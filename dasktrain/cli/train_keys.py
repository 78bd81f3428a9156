"""What each section of a ``dasktrain train`` config accepts, read from the API itself.

The keys of ``[trainer]`` are the keyword arguments of :class:`~dasktrain.Trainer` and the
options of the update modes, found in their signatures together with their defaults and
annotated types; ``[optimizer]``'s are the fields of
:class:`~dasktrain.trainer.optim.OptimizerConfig`. Only the descriptions are written here.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from typing import Any

from dasktrain.cli import _toml_writer

__all__ = ["ELSEWHERE", "REQUIRED", "SECTIONS", "all_mode_options", "config_keys",
           "config_reference", "mentioned", "mode_option_defaults", "mode_parameters",
           "optimizer_fields", "trainer_parameters", "type_name", "type_ok"]

SECTIONS = ("data", "model", "loss", "optimizer", "trainer", "run")

REQUIRED = object()

# Keyword arguments of the Trainer that a config file does not set here, and why not.
ELSEWHERE = {
    "model": "set it in [model]",
    "loss": "set it in [loss]",
    "optimizer": "set it in [optimizer]",
    "progress": "use the --no-progress flag",
    "checkpoint_every": "set it in [run]",
    "mode_options": "write the mode's options as keys of [trainer]",
    "transform": "a function: use the Python API (dt.Trainer)",
    "step": "a function: use the Python API (dt.Trainer)",
}

_DOCS: dict[str, dict[str, str]] = {
    "data": {
        "path": "dataset directory or URL, as written by `dasktrain prepare`",
        "split": "split to train on (default: the whole dataset)",
        "validation": "split evaluated after every epoch (default: none)",
        "storage_options": "fsspec options of a remote dataset, an inline table",
    },
    "model": {
        "factory": "function returning a fresh torch.nn.Module: \"models.py:mlp\" (a file) "
                   "or \"package.module:function\"",
        "kwargs": "keyword arguments of the factory, an inline table",
    },
    "loss": {
        "name": "a function of torch.nn.functional (\"cross_entropy\", \"mse_loss\", ...) "
                "or \"file.py:function\" / \"module:function\"",
        "kwargs": "keyword arguments bound to the loss (e.g. {label_smoothing = 0.1})",
    },
    "optimizer": {
        "name": "sgd | adam | adamw | lars | lamb (defaults below: dt.optim.<name>'s), "
                "or torch (any element-wise torch.optim class, see torch_class)",
        "lr": "base learning rate",
        "momentum": "SGD and LARS momentum",
        "nesterov": "SGD Nesterov momentum (needs momentum > 0)",
        "weight_decay": "L2 penalty (SGD, Adam, LARS) or decoupled decay (AdamW, LAMB)",
        "betas": "Adam/AdamW/LAMB moment decay rates, [b1, b2]",
        "eps": "Adam/AdamW/LAMB denominator term; LARS: added to the gradient norm",
        "trust_coefficient": "LARS trust ratio coefficient",
        "exclude_bias_and_norm": "no weight decay for biases and norm weights (default: on "
                                 "for LARS/LAMB)",
        "groups": "parameter groups: [{patterns = [\"head.*\"], lr = 0.1, weight_decay = 0}]",
        "warmup_steps": "updates of linear warm-up",
        "schedule": "constant | cosine | linear | step (after warm-up)",
        "total_steps": "length of the cosine/linear decay (default: the fit's updates)",
        "step_size": "`step` schedule: updates between decays",
        "gamma": "`step` schedule: factor per decay",
        "torch_class": "name = \"torch\": the class, e.g. \"torch.optim.RMSprop\"",
        "options": "the optimizer's own keyword arguments, e.g. {alpha = 0.9}",
    },
    "trainer": {
        "epochs": "epochs to train (counted from 0; a --resume runs the rest)",
        "metrics": "named metrics measured in training and validation: accuracy, topK "
                   "(e.g. top5), mae, mse, or \"file.py:function\" (default: none)",
        "mode": "sync | average | soft | ssp | async",
        "workers": "model replicas (Dask tasks), or [least, most] to follow the cluster",
        "batch_size": "samples per batch PER WORKER",
        "seed": "seed of the epoch plans (shuffling)",
        "shuffle": "shuffle every epoch",
        "prefetch": "blocks' worth of rows in flight per worker",
        "shuffle_blocks": "blocks whose rows are shuffled together",
        "block_rows": "rows per read block (default: the dataset's chunk rows)",
        "drop_last": "drop the last incomplete global batch",
        "as_dict": "batches by array name, model(**inputs): a dataset of several arrays",
        "device": "device of the replicas (default: CUDA where a worker has one)",
        "holder_worker": "address of the worker holding the parameters (default: most "
                         "memory)",
        "holder_shards": "actors the holder is split into, over the hosts (sync only)",
        "assignment": "auto | dynamic | static: batches claimed on demand or a fixed "
                      "stride per worker",
        "timeout": "seconds any single wait may take",
        "barrier_timeout": "seconds a sync step waits for a silent worker",
        "direct_channel": "push over a direct TCP connection to the holder",
        "shared_memory": "workers on the holder's host push through shared memory",
        "balance": "sync: a faster worker takes more of each step's rows",
        "bucket_bytes": "least bytes of a gradient bucket sent during backward",
        "on_nonfinite": "raise | skip: a non-finite loss or gradient",
        "nonfinite_patience": "refused rounds in a row that stop a run under skip",
        "history_updates": "keep the last this many updates' records in the History "
                           "(default: all)",
        "torch_threads": "torch threads per worker process (0: torch's default)",
        "pause_dask_profiler": "pause Dask's statistical profiler on workers that train",
        "precision": "\"32\" | \"bf16\" | \"fp16\"",
        "clip_grad_norm": "clip the applied gradient to this global norm",
        "clip_grad_value": "clip each applied gradient value to [-v, v]",
        "average_every": "average: local steps between averages",
        "average_optimizer_state": "average: average the optimizer state too",
        "wait_for": "soft: gradients per update (default: workers - 1)",
        "late": "soft: next | drop, for late gradients",
        "staleness_bound": "ssp: clocks a worker may lead the slowest",
        "staleness_lr": "async/soft/ssp: inverse | sqrt learning-rate scale by staleness",
        "dc_lambda": "async/soft/ssp: DC-ASGD delay compensation strength",
        "dc_adaptive": "async/soft/ssp: adaptive DC-ASGD (needs dc_lambda)",
        "dc_momentum": "async/soft/ssp: running mean factor of adaptive DC-ASGD",
        "dc_eps": "async/soft/ssp: denominator term of adaptive DC-ASGD",
        "momentum_compensation": "async/soft/ssp: lower the optimizer's momentum by the "
                                 "momentum staleness adds",
    },
    "run": {
        "dir": "run directory (default: runs/<config name>; the --run-dir flag wins)",
        "checkpoint_every": "also checkpoint every this many updates (default: every epoch)",
    },
}



# -- what each section accepts ---------------------------------------------------------
def _annotations(fn: Any, owner: Any = None) -> dict[str, Any]:
    """Each annotation of ``fn`` (or the fields of dataclass ``owner``) evaluated, where
    it can be (a string annotation may name what its module imports for type checking
    only); the others are left out and not type-checked."""
    if owner is not None:
        raw, namespace = owner.__annotations__, vars(sys.modules[owner.__module__])
    else:
        raw, namespace = fn.__annotations__, fn.__globals__
    hints = {}
    for name, annotation in raw.items():
        try:  # the string annotations of this package's own signatures
            hints[name] = eval(annotation, namespace) if isinstance(annotation, str) \
                else annotation
        except Exception:
            continue
    return hints


def trainer_parameters() -> dict[str, tuple[Any, Any]]:
    """Keys of ``[trainer]`` and ``[run]`` from ``Trainer.__init__``: name -> (default,
    type)."""
    from dasktrain.trainer.driver.trainer import Trainer

    hints = _annotations(Trainer.__init__)
    out = {}
    for p in inspect.signature(Trainer.__init__).parameters.values():
        if p.name == "self" or p.kind is p.VAR_KEYWORD:
            continue
        default = REQUIRED if p.default is p.empty else p.default
        out[p.name] = (default, hints.get(p.name))
    return out


def mode_parameters(mode: str) -> dict[str, tuple[Any, Any]]:
    """Options of ``mode`` from its class's constructors: name -> (default, type)."""
    from dasktrain.trainer.modes import mode_class

    out = {}
    for cls in reversed(mode_class(mode).__mro__):
        init = cls.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        hints = _annotations(init)
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                out[p.name] = (p.default, hints.get(p.name))
    return out


def mode_option_defaults(mode: str) -> dict[str, Any]:
    """The options of update mode ``mode`` and their defaults (unknown modes raise)."""
    return {name: default for name, (default, _) in mode_parameters(mode).items()}


def all_mode_options() -> dict[str, list[str]]:
    """Every option of any update mode -> the modes that take it."""
    from dasktrain.trainer.modes import MODES

    owners: dict[str, list[str]] = {}
    for mode in MODES:
        for name in mode_parameters(mode):
            owners.setdefault(name, []).append(mode)
    return owners


def optimizer_fields() -> dict[str, Any]:
    """The fields of ``OptimizerConfig`` (the keys of ``[optimizer]``) -> their types."""
    from dasktrain.trainer.optim import OptimizerConfig

    hints = _annotations(None, owner=OptimizerConfig)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(OptimizerConfig)}


def config_keys() -> dict[str, list[str]]:
    """Every key each section accepts (``[trainer]``: with every mode's options)."""
    trainer = ["epochs", "metrics"] + [k for k in trainer_parameters()
                                       if k not in ELSEWHERE and k != "metrics"]
    return {
        "data": list(_DOCS["data"]),
        "model": list(_DOCS["model"]),
        "loss": list(_DOCS["loss"]),
        "optimizer": list(optimizer_fields()),
        "trainer": trainer + [k for k in all_mode_options() if k not in trainer],
        "run": ["dir", "checkpoint_every"],
    }


# -- value checks ----------------------------------------------------------------------
def type_ok(value: Any, hint: Any) -> bool | None:
    """Whether a TOML value fits the annotation ``hint`` (None: cannot tell)."""
    if hint is None or hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [type_ok(value, arg) for arg in typing.get_args(hint)]
        return True if True in results else (None if None in results else False)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple or hint is tuple:
        return isinstance(value, (list, tuple)) or None
    if origin is dict or hint is dict:
        return isinstance(value, dict) or None
    return None


def type_name(hint: Any) -> str:
    """The annotation ``hint`` as a config file's user reads it ("an integer")."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if isinstance(hint, type):
        return {"bool": "true or false", "int": "an integer", "float": "a number",
                "str": "a string"}.get(hint.__name__, hint.__name__)
    return str(hint).replace("typing.", "")


def mentioned(message: str, keys: list[str]) -> list[str]:
    """The ``keys`` that ``message`` names as words."""
    return [k for k in keys if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)]


def config_reference(width: int = 100) -> str:
    """Every section and key of the config file with its default, as help text."""
    defaults: dict[str, Any] = {k: d for k, (d, _) in trainer_parameters().items()}
    for modes in all_mode_options().values():
        for mode in modes:
            defaults.update(mode_option_defaults(mode))
    required = {("data", "path"), ("model", "factory"), ("loss", "name"),
                ("optimizer", "name"), ("trainer", "epochs")}
    lines = ["config file: TOML, one table per section; * required; relative paths start at",
             "the config file's directory; defaults as shown (those of dt.Trainer, the mode,",
             "and dt.optim.<name>), examples/digits.toml shows every key."]
    for section, keys in config_keys().items():
        lines.append(f"  [{section}]")
        for key in keys:
            entry = key
            if (section, key) in required:
                entry += " *"
            elif section in ("trainer", "run") and defaults.get(key) not in (None, REQUIRED):
                entry += f" = {_toml_writer.format_value(defaults[key])}"
            text = _DOCS[section].get(key, "see dt.Trainer")
            column = max(len(entry) + 2, 30)
            wrapped = textwrap.wrap(text, width - 4 - column) or [""]
            lines.append(f"    {entry:<{column}}{wrapped[0]}")
            lines.extend(" " * (4 + column) + more for more in wrapped[1:])
    lines.append("  A mode's options are refused under another mode; sgd and lars need lr.")
    return "\n".join(lines)
