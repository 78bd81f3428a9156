"""Small models and fitness functions shared by the evolution tests."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import torch


def tiny_net() -> torch.nn.Module:
    """4 -> 6 tanh -> 1: 37 parameters."""
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def fit_sum(model: torch.nn.Module, seed: int) -> float:
    """Reward: minus the squared error of predicting the sum of 4 inputs (32 drawn from
    ``seed``)."""
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((32, 4)).astype(np.float32))
    return -float(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())


def fit_sum_killing_once(model: torch.nn.Module, seed: int, marker: str, victim: str
                         ) -> float:
    """:func:`fit_sum`, but the first call on the worker at address ``victim`` after
    ``marker``'s directory holds ``arm`` kills its process (SIGKILL), once per test."""
    from distributed import get_worker

    armed = Path(marker).parent / "arm"
    if armed.exists() and not Path(marker).exists() and get_worker().address == victim:
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return fit_sum(model, seed)


def fit_sum_closing_once(model: torch.nn.Module, seed: int, marker: str) -> float:
    """:func:`fit_sum`, but the first call after ``marker``'s directory holds ``arm`` closes
    its worker (one running in the test's own process: as if it died) and waits until it
    has stopped, so that the data it held is gone with it."""
    from distributed import get_worker

    from tests.common.builders import wait_for

    armed = Path(marker).parent / "arm"
    if armed.exists() and not Path(marker).exists():
        Path(marker).touch()
        worker = get_worker()
        worker.loop.add_callback(worker.close, executor_wait=False, nanny=False)
        wait_for(lambda: worker.status.name in ("closed", "failed"), 30,
                 "the worker to close")
    return fit_sum(model, seed)


def say_hello(model: torch.nn.Module, seed: int) -> str:
    """A reward that is not a number."""
    return "hello"


def nan_reward(model: torch.nn.Module) -> float:
    return float("nan")


def huge_reward(model: torch.nn.Module) -> float:
    """A finite reward beyond float32's range, in which fitness travels."""
    return 1e39


def huge_negative_reward(model: torch.nn.Module) -> float:
    """A finite reward below float32's lowest value."""
    return -1e39


def near_float32_max(model: torch.nn.Module, seed: int) -> float:
    """A reward within float32's range whose sum over a population is not."""
    return 3e38 + 1e37 * np.random.default_rng(seed).random()


def refusing_reward(model: torch.nn.Module) -> float:
    raise ValueError("this reward refuses every model")


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def drop_copies() -> int:
    """Runs on a worker: forget every run's copy of the state, as a restarted worker would
    have none; returns how many there were."""
    from dasktrain.evolve.worker import replica

    runs = list(replica._REPLICAS)
    for run in runs:
        replica.forget_run(run)
    return len(runs)


def nudge_copies() -> int:
    """Runs on a worker: move every ES copy of the state it holds a little (as other float
    arithmetic would); returns how many it moved."""
    from dasktrain.evolve.worker import replica

    copies = list(replica._REPLICAS.values())
    for copy in copies:
        with copy.lock:
            copy.state.params += np.float32(1e-3)
    return len(copies)


def fit_sum_slowly_on(model: torch.nn.Module, seed: int, slow: str, seconds: float) -> float:
    """:func:`fit_sum`, taking ``seconds`` longer on the worker at address ``slow`` (its
    process sleeps, as a slower machine would be busy)."""
    import time

    from distributed import get_worker

    if get_worker().address == slow:
        time.sleep(seconds)
    return fit_sum(model, seed)
