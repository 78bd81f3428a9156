"""The holder's side of the wire: the parameter holder (a Dask actor) and what runs inside it.

:mod:`.actor` (``ParameterHolder``: a thin façade over the wire), :mod:`.config`
(``HolderConfig``), :mod:`.roster` (who trains under which incarnation, what each holds:
membership, fencing, the one way out), :mod:`.ledger` (the batches of work claimed on
demand), :mod:`.epochs` (the epoch's life as one state machine), :mod:`.host` (the versioned
state a mode sees: updates, holds, what goes back to the pool), :mod:`.watchdog` (dropping
the dead and the silent), :mod:`.arithmetic` (the master buffer, the optimizer step,
averaging, the serial section), :mod:`.records` (what each update and gradient leaves in the
History), :mod:`.balance` (uneven shares of a ``sync`` step),
:mod:`.divergence` (refusing non-finite gradients, and when that must stop a run),
:mod:`.waiters` (checkpoints awaited at a version), :mod:`.footprint` (what it keeps,
counted, for the soak) and :mod:`.shards` (the plan of a holder
split over several workers; the views that call the shards are in
:mod:`dasktrain.trainer.exchange.sharded`). What each mode
does with a gradient is in :mod:`dasktrain.trainer.modes`; the optimizers it runs are in
:mod:`dasktrain.trainer.optim`.
"""

from dasktrain.trainer.holder.actor import ParameterHolder
from dasktrain.trainer.holder.config import HolderConfig

__all__ = ["HolderConfig", "ParameterHolder"]
