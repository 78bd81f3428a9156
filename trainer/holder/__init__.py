"""The holder's side of the wire: the parameter holder (a Dask actor) and what runs inside it.

:mod:`.actor` (``ParameterHolder``: workers, versions, the mode it hosts, checkpoints of its
state), :mod:`.arithmetic` (the master buffer, the optimizer step, averaging, the serial
section), :mod:`.membership` (who trains, their clocks, the watchdog), :mod:`.records` (what
each update and gradient leaves in the History), :mod:`.divergence` (when non-finite updates
must stop a run) and :mod:`.shards` (the holder split over several workers). What each mode
does with a gradient is in :mod:`dasktrain.trainer.modes`; the optimizers it runs are in
:mod:`dasktrain.trainer.optim`.
"""

from dasktrain.trainer.holder.actor import HolderConfig, ParameterHolder

__all__ = ["HolderConfig", "ParameterHolder"]
