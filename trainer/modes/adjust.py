"""What the modes that apply stale gradients (``async``, ``soft``, ``ssp``) do to each update.

Always, so that an optimizer's settings mean what they mean in ``sync``:

* **The learning rate is per global batch.** ``sync`` takes one step per global batch (W
  workers x ``batch_size`` samples); these modes take one per gradient or per S of them.
  An update of n samples is applied at ``lr x n / (W x batch_size)`` (``async``: 1/W of
  the rate for a full batch; ``soft`` taking S of N: S/N), so a rate moves the parameters
  as far per sample as in ``sync``. An update holding a gradient from every worker still in
  the epoch, all fresh, is the step ``sync`` would take and gets the full rate (so ``soft``
  waiting for all N is ``sync``, and one worker alone trains as one process).
* **Momentum is compensated** (``momentum_compensation=True``, the default): staleness acts
  as momentum of its own, μ = τ̄ / (1 + τ̄) per update for the mean staleness τ̄ seen. Under
  a heavy-ball momentum (SGD, LARS) the optimizer's momentum is lowered by μ counted per
  global batch, and towards μ per update when the training loss rises; under an averaging
  one (Adam, AdamW, LAMB: its first beta) the step is scaled by 1 - μ instead, its beta
  kept (see :mod:`.momentum`).

Options:

* ``staleness_lr``: the learning rate of a gradient of staleness τ is scaled by λ(τ):
  ``"inverse"`` 1/(1+τ), ``"sqrt"`` 1/√(1+τ), or a callable ``f(τ) -> float`` (defined at
  module level, so that it reaches the holder). An update of several gradients averages
  them with weights ``batch size x λ(τ)`` and scales its step's learning rate by their
  batch-size-weighted mean λ: under SGD that is exactly each gradient scaled by its own
  λ(τ), and under every optimizer the step shrinks with staleness (scaling the gradient
  alone would do nothing under Adam, which normalises its size away).
* ``dc_lambda`` (DC-ASGD, Zheng et al., ICML 2017): a gradient ``g`` computed on the
  parameters ``w_sent`` that its worker last received is applied as
  ``g + λ·g⊙g⊙(w_now - w_sent)``, a first-order correction for what changed since. The
  holder keeps ``w_sent`` per worker (parameters only: buffers are not compensated).
  ``dc_adaptive=True`` uses ``λ / sqrt(ms + eps)`` elementwise, where ``ms`` is a running
  mean of ``g⊙g`` (``ms ← m·ms + (1-m)·g⊙g``, ``m = dc_momentum``), as in DC-ASGD-a.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dasktrain.trainer.holder.divergence import all_finite
from dasktrain.trainer.holder.mean import as_tensor
from dasktrain.trainer.modes.base import Adjust, Adjusted, Contribution, Host, UpdateMode
from dasktrain.trainer.modes.momentum import ImplicitMomentum, Relaxation, compensated, step_factor

__all__ = ["StaleGradientMode", "staleness_rule"]

StalenessRule = Callable[[int], float]

_RULES: dict[str, StalenessRule] = {
    "inverse": lambda tau: 1.0 / (1.0 + tau),
    "sqrt": lambda tau: 1.0 / math.sqrt(1.0 + tau),
}


def staleness_rule(rule: str | StalenessRule | None) -> StalenessRule | None:
    """The function of a ``staleness_lr`` option (None: no scaling)."""
    if rule is None:
        return None
    if isinstance(rule, str):
        try:
            return _RULES[rule]
        except KeyError:
            raise ValueError(f"staleness_lr must be one of {sorted(_RULES)} or a callable, "
                             f"got {rule!r}") from None
    if callable(rule):
        return rule
    raise TypeError(f"staleness_lr must be a rule name or a callable, got "
                    f"{type(rule).__name__}")


class StaleGradientMode(UpdateMode):
    """Base of ``async``, ``soft`` and ``ssp``: what their learning rate means (each
    update's share of a global batch, see :meth:`sample_share`), the momentum compensation
    (``momentum_compensation``, see :mod:`.momentum`), the options ``staleness_lr``,
    ``dc_lambda``, ``dc_adaptive`` and ``dc_momentum``, and :meth:`adjust`, which applies
    them when an update is made."""

    def __init__(self, host: Host | None, *, staleness_lr: str | StalenessRule | None = None,
                 dc_lambda: float | None = None, dc_adaptive: bool = False,
                 dc_momentum: float = 0.95, dc_eps: float = 1e-7,
                 momentum_compensation: bool = True, **options: Any) -> None:
        super().__init__(host, **options)
        self.staleness_lr = staleness_rule(staleness_lr)
        if dc_lambda is not None and not (isinstance(dc_lambda, int | float)
                                          and math.isfinite(dc_lambda) and dc_lambda >= 0):
            raise ValueError(f"dc_lambda must be a finite number >= 0, got {dc_lambda!r}")
        if not 0 <= dc_momentum < 1:
            raise ValueError(f"dc_momentum must be in [0, 1), got {dc_momentum!r}")
        if dc_eps <= 0:
            raise ValueError(f"dc_eps must be positive, got {dc_eps!r}")
        if dc_adaptive and dc_lambda is None:
            raise ValueError("dc_adaptive=True needs dc_lambda (the base λ)")
        if not isinstance(momentum_compensation, bool):
            raise TypeError(f"momentum_compensation must be True or False, got "
                            f"{momentum_compensation!r}")
        self.dc_lambda = None if dc_lambda is None else float(dc_lambda)
        self.dc_adaptive = bool(dc_adaptive)
        self.dc_momentum = float(dc_momentum)
        self.dc_eps = float(dc_eps)
        self.momentum_compensation = momentum_compensation
        self._sent: dict[int, torch.Tensor] = {}  # w_sent per worker (DC only)
        self._mean_square: torch.Tensor | None = None
        self._scratch: dict[int, np.ndarray] = {}
        self._records_fields = (self.staleness_lr is not None or self.dc_lambda is not None
                                or type(self).fields is not StaleGradientMode.fields)
        self._momentum: float | None = None  # the optimizer's own, when compensated
        self._implicit: ImplicitMomentum | None = None
        self._relaxation: Relaxation | None = None  # per update .. per global batch
        self._through_step = False  # compensated by the step's size (averaging momentum)
        self.adjuster: Adjust | None = None  # what to pass as apply's adjust
        if host is None:
            return
        own = host.optimizer.first_moment
        if momentum_compensation and own:
            self._momentum = own
            self._implicit = ImplicitMomentum(self.expected_staleness())
            self._through_step = host.optimizer.first_moment_is_average
            # Without a batch size every update counts as a whole one; an averaging
            # momentum's step keeps the per-update rule (see .momentum).
            if host.batch_size is not None and not self._through_step:
                self._relaxation = Relaxation(host.workers * host.batch_size)
        shares = host.batch_size is not None and host.workers > 1
        # Without anything to change, an update is the host's plain one: no per-push work
        # on the hot path.
        if self._records_fields or shares or self._implicit is not None:
            self.adjuster = self.adjust

    def expected_staleness(self) -> float:
        """The mean staleness of the applied gradients before any is seen: with every
        worker computing, each gradient waits for the W - 1 others' (override)."""
        return float(self.host.workers - 1)

    # -- hooks ---------------------------------------------------------------------------
    def sent(self, worker: int) -> None:
        if self.dc_lambda is None:
            return
        params = self.host.parameters
        shadow = self._sent.get(worker)
        if shadow is None:
            self._sent[worker] = params.clone()
        else:
            shadow.copy_(params)

    def state_dict(self) -> dict[str, Any]:
        return {"sent": {w: t.clone() for w, t in self._sent.items()},
                "mean_square": None if self._mean_square is None
                else self._mean_square.clone(),
                "implicit_momentum": None if self._implicit is None
                else self._implicit.state_dict(),
                "relaxation": None if self._relaxation is None
                else self._relaxation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sent = {int(w): t.clone() for w, t in state.get("sent", {}).items()}
        ms = state.get("mean_square")
        self._mean_square = None if ms is None else ms.clone()
        if self._implicit is not None and state.get("implicit_momentum") is not None:
            self._implicit.load_state_dict(state["implicit_momentum"])
        if self._relaxation is not None and state.get("relaxation") is not None:
            self._relaxation.load_state_dict(state["relaxation"])

    # -- the arithmetic ------------------------------------------------------------------
    def fields(self, contribution: Contribution) -> dict[str, Any]:
        """The mode's own record fields of a gradient being applied (override)."""
        del contribution
        return {}

    def sample_share(self, contributions: list[Contribution]) -> float:
        """The factor on the learning rate of an update of ``contributions``: the share of
        a global batch (``workers`` x ``batch_size`` samples, what one ``sync`` step
        averages) that its samples make up, so that a learning rate moves the parameters
        as far per sample in every mode. An update of a gradient from every worker still in
        the epoch, all computed on the current parameters, is the step ``sync`` would take,
        and gets its full rate. 1 when the host knows no batch size."""
        host = self.host
        if host.batch_size is None:
            return 1.0
        version = host.version
        if all(c.version == version for c in contributions) \
                and host.live_workers() <= {c.worker for c in contributions}:
            return 1.0
        return sum(c.count for c in contributions) / (host.workers * host.batch_size)

    def compensation(self, contributions: list[Contribution], total: float, share: float
                     ) -> tuple[float | None, float]:
        """``(momentum, factor on the learning rate)`` of an update of ``contributions``
        (``total`` samples, ``share`` of a global batch: see :meth:`sample_share`), from
        the implicit momentum μ of the staleness seen so far, this update's included (see
        :mod:`.momentum`): a heavy-ball momentum lowered by μ counted per global batch, or
        per update as far as the loss's rises have tightened it; an averaging one kept and
        the step scaled by 1 - μ; ``(None, 1)`` when not compensated."""
        if self._implicit is None:
            return None, 1.0
        version = self.host.version
        staleness = sum(c.count * (version - c.version) for c in contributions) / total \
            if total else 0.0
        self._implicit.observe(staleness)
        implicit = self._implicit.value
        if self._through_step:
            return None, step_factor(implicit)
        momentum = compensated(self._momentum, implicit)  # per update: the most damped
        relaxation = self._relaxation
        if relaxation is not None and total:
            relaxation.observe(sum(c.count * c.loss for c in contributions) / total, total)
            momentum = relaxation.between(momentum,
                                          compensated(self._momentum, implicit, share))
        return momentum, 1.0

    def adjust(self, contributions: list[Contribution]) -> Adjusted:
        """This update's learning-rate share, momentum, staleness scaling and delay
        compensation (serial section)."""
        host = self.host
        counts = [float(c.count) for c in contributions]
        total = sum(counts)
        share = self.sample_share(contributions)
        first_moment, factor = self.compensation(contributions, total, share)
        lr_scale = share * factor
        if not self._records_fields:
            return Adjusted(lr_scale=lr_scale, first_moment=first_moment)
        scales = [1.0] * len(contributions)
        if self.staleness_lr is not None:
            scales = [float(self.staleness_lr(host.version - c.version))
                      for c in contributions]
            for c, scale in zip(contributions, scales, strict=True):
                if not (math.isfinite(scale) and scale >= 0):
                    raise ValueError(f"staleness_lr gave {scale!r} for staleness "
                                     f"{host.version - c.version}: it must be a finite "
                                     "number >= 0")
        payloads = None
        compensated_dc = [False] * len(contributions)
        if self.dc_lambda is not None:
            payloads = []
            for i, c in enumerate(contributions):
                payload, compensated_dc[i] = self._compensate(c)
                payloads.append(payload)
        if total:
            lr_scale *= sum(n * s for n, s in zip(counts, scales, strict=True)) / total
        return Adjusted(
            payloads=payloads,
            weights=[n * s for n, s in zip(counts, scales, strict=True)]
            if self.staleness_lr is not None else None,
            lr_scale=lr_scale, first_moment=first_moment,
            fields=[{"scale": s, "compensated": comp, **self.fields(c)}
                    for c, s, comp in zip(contributions, scales, compensated_dc,
                                          strict=True)])

    def _compensate(self, c: Contribution) -> tuple[np.ndarray, bool]:
        """``g + λ·g⊙g⊙(w_now - w_sent)`` on the parameter part of ``c``'s payload."""
        shadow = self._sent.get(c.worker)
        n = self.host.layout.num_params
        grads = as_tensor(c.grads)
        g = grads[:n]
        if not all_finite(g):
            # The holder refuses it: it must not reach the running mean square either,
            # where it would poison every later gradient.
            return c.grads, False
        if self.dc_adaptive:
            square = g * g
            if self._mean_square is None:
                self._mean_square = square.clone()
            else:
                self._mean_square.mul_(self.dc_momentum).add_(square,
                                                              alpha=1 - self.dc_momentum)
        if shadow is None:  # no parameters were sent to it yet (cannot happen in a run)
            return c.grads, False
        out = self._scratch.get(c.worker)
        if out is None or out.shape != c.grads.shape:
            out = self._scratch[c.worker] = np.empty_like(c.grads)
        result = as_tensor(out)
        result.copy_(grads)
        delta = self.host.parameters - shadow
        factor = g * g * delta
        if self.dc_adaptive:
            factor.div_(self._mean_square.add(self.dc_eps).sqrt_())
        result[:n].add_(factor, alpha=self.dc_lambda)
        return out, True
