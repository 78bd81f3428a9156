"""Optimizers that run on the parameter holder (``dt.optim``), described by small configs.

``dt.optim.sgd(lr=0.1, momentum=0.9)`` is an :class:`OptimizerConfig`: plain data, cheap to
send to the holder's worker and to store in a checkpoint. The holder builds the
``torch.optim`` optimizer from it over one flat parameter buffer. Element-wise optimizers
(SGD, Adam, AdamW, and any ``torch.optim`` class through :func:`torch_optimizer`) give on
the buffer exactly what they give on the model's tensors; LARS and LAMB scale each tensor's
update by a *trust ratio* of its norms, computed per segment of the buffer
(:meth:`dasktrain.trainer.flat.FlatLayout.param_segments`).

Parameter groups (:func:`group`) give tensors chosen by name their own learning rate and
weight decay, and ``exclude_bias_and_norm=True`` takes biases and normalisation weights out
of weight decay; the holder optimises each run of consecutive tensors sharing settings as
one view of its buffer (:mod:`.flat`).

The room: :mod:`.config` (the config and groups), :mod:`.registry` (names to builders; the
built-in entries are the table below: adding an optimizer is a module and an entry there,
or :func:`register_optimizer` at run time),
:mod:`.builtin`, :mod:`.large_batch` (LARS, LAMB), :mod:`.torch_class` (any element-wise
class), :mod:`.factories` (these front doors), :mod:`.flat` (the optimizer over the flat
buffer) and :mod:`.state` (its state as one flat array, for ``average`` mode).
"""

from dasktrain.trainer.optim import builtin, torch_class
from dasktrain.trainer.optim.config import OptimizerConfig, ParamGroup, group
from dasktrain.trainer.optim.factories import (
    adam,
    adamw,
    get_optimizer,
    lamb,
    lars,
    sgd,
    torch_optimizer,
)
from dasktrain.trainer.optim.registry import (
    OPTIMIZERS,
    OptimizerKind,
    add_built_in,
    optimizer_kind,
    register_optimizer,
)

add_built_in({
    "sgd": OptimizerKind(builtin.build_sgd, first_moment="momentum"),
    "adam": OptimizerKind(builtin.build_adam, first_moment="betas"),
    "adamw": OptimizerKind(builtin.build_adamw, first_moment="betas"),
    "lars": OptimizerKind(builtin.build_lars, per_tensor=True, check=builtin.no_options,
                          first_moment="momentum"),
    "lamb": OptimizerKind(builtin.build_lamb, per_tensor=True, check=builtin.no_options,
                          first_moment="betas"),
    "torch": OptimizerKind(torch_class.build, check=torch_class.check),
})

__all__ = ["OPTIMIZERS", "OptimizerConfig", "OptimizerKind", "ParamGroup", "adam", "adamw",
           "get_optimizer", "group", "lamb", "lars", "optimizer_kind", "register_optimizer",
           "sgd", "torch_optimizer"]
