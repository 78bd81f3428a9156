"""What an update mode is, and the host interface the parameter holder offers it.

A mode decides *when* and *what* the holder applies; the holder (the host) does the
arithmetic, the bookkeeping, the watchdog, checkpoints and the wire. A mode is one module
with a subclass of :class:`UpdateMode` and one entry in :data:`dasktrain.trainer.modes.MODES`.

Hooks a mode implements (all optional except :meth:`UpdateMode.push`):

* ``push(contribution)``: a worker's gradient (or parameters) arrived; return once it is
  applied, kept for later, or dropped. The reply (fresh parameters) is the host's business.
* ``joined(worker)``, ``left(worker)``, ``lost(worker)``: membership changed (a pending
  update may be complete now). The worker's clock is ``host.clocks[worker]``.
* ``sent(worker)``: parameters were just handed to ``worker`` (at join and in every reply),
  inside the serial section, so ``host.parameters`` is what it received.
* ``taken(contributions)``: an update took ``contributions`` (applied or refused them),
  inside the serial section, in order with checkpoints: what a mode keeps of pushes it
  holds for later leaves its checkpointed state here.
* ``waiting_for()``: the workers a pending update waits for; the watchdog drops those
  that died or stay silent.
* ``state_dict()`` / ``load_state_dict(state)``: the mode's own state (clocks are the
  host's), in the checkpoint; plain containers and tensors only.
* ``abort(error)``: fail whatever still waits.

What the host offers (:class:`Host`):

* ``apply(contributions, adjust=None, advance=False)``: the sample-weighted mean of the
  gradients as one optimizer step. ``adjust``, run in the serial section right before the
  step, may return other payloads and weights, a learning-rate scale for this step (which
  works under every optimizer; scaling a gradient does nothing under Adam), the
  optimizer's momentum for this step and each gradient's record fields
  (:class:`Adjusted`).
* ``set_state(contributions, values)``: parameters (then buffers) outright, for averaging.
* ``drop_gradient(contribution, reason)``: record a gradient that is not applied.
* ``hold(contribution)``: count a contribution the mode keeps for a later update (in the
  serial section), so that a checkpoint taken meanwhile resumes after its batch.
* ``give_back(contribution, reason)``: take nothing of a push of claimed work: its batches
  go back to the pool, to be trained again (``average``: parameters that fell behind).
* ``serially(fn, *args)``: a section ordered with every update, snapshot and restore.
* ``parameters`` and ``values`` (parameters then buffers): read-only views, for the serial
  section; ``version``, ``epoch``, ``epoch_start``, ``clocks``, ``batches_taken(worker)``,
  ``live_workers()``, ``workers``, ``batch_size``, ``layout``, ``optimizer``,
  ``record_event(text)``.

Per-gradient record fields a mode adds are declared once, in ``gradient_fields``, and
passed in ``Adjusted.fields`` or to ``drop_gradient``: the History and the update log pick
them up by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from dasktrain.trainer.worker.steps import GradientStep, WorkerStep

if TYPE_CHECKING:
    from dasktrain.trainer.flat import FlatLayout
    from dasktrain.trainer.optim import OptimizerConfig

__all__ = ["Adjust", "Adjusted", "Contribution", "Host", "UpdateMode"]


@dataclasses.dataclass(slots=True)
class Contribution:
    """One worker's push: the gradient of its batch at the parameters of ``version`` (or,
    in parameter-averaging modes, its parameters after local steps).

    ``grads`` may be a buffer the sender reuses for its next push (the direct channel's
    receive buffer): it is valid until the mode's :meth:`UpdateMode.push` returns, so a mode
    that keeps a gradient beyond that must copy it.
    """

    worker: int
    version: int
    grads: np.ndarray | None  # payload (gradients then buffers); None: no batch this step
    count: int  # samples in the batch (the weight in an average)
    loss: float
    position: tuple[int, int]  # the worker's (epoch, batches consumed) after this batch
    clock: int = 0  # contributions of this worker before this one (set by the host)
    held: bool = False  # counted in the worker's clock and position (see Host.hold)


@dataclasses.dataclass(slots=True)
class Adjusted:
    """What a mode's ``adjust`` makes of the contributions of one update (each list, when
    given, has one entry per contribution, in the order given)."""

    payloads: list[np.ndarray] | None = None
    """Payloads to average instead of the contributions' own."""
    weights: list[float] | None = None
    """Weights in the average instead of the batch sizes."""
    lr_scale: float = 1.0
    """Factor on this step's learning rate (works under every optimizer)."""
    first_moment: float | None = None
    """The optimizer's momentum (Adam's first beta) for this step; None: as configured."""
    fields: list[dict[str, Any]] | None = None
    """Each gradient's record fields: ``scale``, ``compensated`` and the mode's own."""


Adjust = Callable[[list[Contribution]], Adjusted]


class Host(Protocol):
    """The parameter holder as a mode sees it."""

    workers: int
    batch_size: int | None  # samples in a worker's full batch (None: not known)
    layout: FlatLayout
    optimizer: OptimizerConfig

    @property
    def version(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def epoch_start(self) -> int: ...
    @property
    def clocks(self) -> Sequence[int]: ...
    @property
    def parameters(self) -> torch.Tensor: ...
    @property
    def values(self) -> torch.Tensor: ...

    @property
    def claims_work(self) -> bool: ...

    def live_workers(self) -> set[int]: ...
    def batches_taken(self, worker: int) -> int: ...
    def record_event(self, text: str) -> None: ...

    async def apply(self, contributions: Sequence[Contribution], *,
                    adjust: Adjust | None = None, advance: bool = False) -> None: ...
    async def set_state(self, contributions: Sequence[Contribution],
                        values: torch.Tensor | None) -> None: ...
    def drop_gradient(self, contribution: Contribution, reason: str, **fields: Any) -> None: ...
    def hold(self, contribution: Contribution) -> None: ...
    def give_back(self, contribution: Contribution, reason: str) -> None: ...
    async def serially(self, fn: Any, *args: Any) -> Any: ...


class UpdateMode:
    """Base of the update modes. Hooks run on the holder worker's event loop, never
    concurrently with each other except at ``await`` points."""

    name: ClassVar[str]
    lockstep: ClassVar[bool] = False
    """True when every worker steps through the same number of steps per epoch (those
    without a batch push nothing but their presence)."""
    may_claim_work: ClassVar[bool] = True
    """True when workers may claim their batches from the holder as they go
    (``assignment="dynamic"``, see :mod:`dasktrain.trainer.holder.ledger`): every mode but
    ``sync``, whose every step takes one batch of each worker."""
    balances: ClassVar[bool] = False
    """True when a step's rows may be cut unevenly among the workers, by their speeds (see
    :mod:`dasktrain.trainer.holder.balance`): a lock-step mode whose update averages the
    gradients weighted by rows, the same update however the rows are cut (``sync``)."""
    pushes_runs: ClassVar[bool] = False
    """True when a push of claimed work covers a piece of the run its worker claimed
    (``average``: the local steps between two averages; see :meth:`claim_size`), not one
    batch."""
    early_mean: ClassVar[bool] = False
    """True when a round's update is the plain weighted mean of its gradients (no
    ``adjust``), which the holder may begin while the round's last payloads still arrive
    (see :mod:`dasktrain.trainer.holder.early`): a round mode's ``round`` and
    ``waiting_for`` say what it is made of (``sync``)."""
    gradient_fields: ClassVar[dict[str, Any]] = {}
    """Extra per-gradient record fields and their defaults (see :mod:`..records`)."""
    worker_step: ClassVar[type[WorkerStep]] = GradientStep
    """What workers do per batch (:mod:`dasktrain.trainer.worker.steps`): by default push each
    gradient; ``average`` takes local optimizer steps and pushes parameters."""

    def __init__(self, host: Host | None, **options: Any) -> None:
        """``host`` is None when the options are only being validated."""
        if options:
            raise ValueError(f"mode {self.name!r} takes no option(s) {sorted(options)}")
        self.host = host

    # -- planning (class level: no host needed) ------------------------------------------
    @classmethod
    def check(cls, workers: int, options: dict[str, Any]) -> None:
        """Refuse bad ``options`` for a run of ``workers`` workers, before any cluster
        work."""
        del workers
        cls(None, **options)

    @classmethod
    def planned_updates(cls, batches: int, workers: int, options: dict[str, Any]) -> int:
        """Holder updates in an epoch of ``batches`` batches (for schedules and progress)."""
        del options
        return -(-batches // workers) if cls.lockstep else batches

    @classmethod
    def schedule_length(cls, epoch_steps: Sequence[int], updates: int,
                        options: dict[str, Any]) -> int:
        """Steps the learning-rate schedule spans: by default the holder's ``updates``
        (its optimizer steps); ``epoch_steps`` are the lock-step steps of each epoch."""
        del epoch_steps, options
        return updates

    @classmethod
    def schedule_position(cls, holder_state: dict[str, Any], epoch_steps: Sequence[int],
                          options: dict[str, Any]) -> int:
        """The schedule's step at a holder checkpoint (by default its optimizer steps)."""
        del epoch_steps, options
        return int(holder_state["updates"])

    @classmethod
    def payload_size(cls, layout: FlatLayout, optimizer: OptimizerConfig,
                     options: dict[str, Any]) -> int:
        """Values in one push and one reply."""
        del optimizer, options
        return layout.size

    # -- hooks ---------------------------------------------------------------------------
    async def push(self, contribution: Contribution) -> None:
        """Return once ``contribution`` is applied, kept, or dropped."""
        raise NotImplementedError

    def joined(self, worker: int) -> None:
        """``worker`` (re)joined."""

    async def left(self, worker: int) -> None:
        """``worker`` finished its share of the epoch."""
        await self.membership_changed()

    async def lost(self, worker: int) -> None:
        """``worker`` was dropped (dead or silent); it may come back with a join."""
        await self.membership_changed()

    async def membership_changed(self) -> None:
        """A pending update may be complete now."""

    def sent(self, worker: int) -> None:
        """Parameters were handed to ``worker`` (serial section)."""

    def taken(self, contributions: Sequence[Contribution]) -> None:
        """An update took ``contributions``: applied, or refused as not finite (serial
        section)."""
        del contributions

    def reply(self, worker: int) -> np.ndarray | None:
        """A reply of the mode's own for ``worker`` (serial section), or None for the
        host's current parameters."""
        del worker
        return None

    def claim_size(self, worker: int) -> tuple[int | None, int | None]:
        """How many batches ``worker``'s next claim should hold (None: the ledger's guided
        size, see :mod:`dasktrain.trainer.holder.ledger`), and, where pushes cover runs
        (:attr:`pushes_runs`), how many batches each push covers (None: the whole claim)."""
        del worker
        return None, None

    def start_position(self, worker: int, recorded: int) -> int:
        """Where ``worker`` (re)starts in the epoch; ``recorded`` is the number of its
        batches the holder has taken."""
        del worker
        return recorded

    def waiting_for(self) -> set[int]:
        return set()

    def abort(self, error: BaseException) -> None:
        """Fail every push still waiting."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
