"""The holder's side of the wire: the parameter holder (a Dask actor) and what runs inside it.

:mod:`.actor` (``ParameterHolder``: workers, versions, the mode it hosts, checkpoints of its
state), :mod:`.config` (``HolderConfig``), :mod:`.arithmetic` (the master buffer, the
optimizer step, averaging, the serial section), :mod:`.membership` (who trains, their clocks,
the watchdog), :mod:`.records` (what each update and gradient leaves in the History),
:mod:`.divergence` (refusing non-finite gradients, and when that must stop a run),
:mod:`.waiters` (checkpoints awaited at a version) and :mod:`.shards` (the plan of a holder
split over several workers; the views that call the shards are in
:mod:`dasktrain.trainer.exchange.sharded`). What each mode
does with a gradient is in :mod:`dasktrain.trainer.modes`; the optimizers it runs are in
:mod:`dasktrain.trainer.optim`.
"""

from dasktrain.trainer.holder.actor import ParameterHolder
from dasktrain.trainer.holder.config import HolderConfig

__all__ = ["HolderConfig", "ParameterHolder"]
