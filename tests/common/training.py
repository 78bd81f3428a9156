"""Small models, losses and reference training loops shared by the trainer tests."""

from __future__ import annotations

import collections
import functools
import os
import signal
import time
from pathlib import Path

import torch

import dasktrain as dt
from dasktrain._cluster import worker_info
from dasktrain.trainer.holder.config import HolderConfig
from dasktrain.trainer.worker.epoch import trainer_place


def mlp(width: int = 4, hidden: int = 8, out: int = 1, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, out))


def random_init(directory: str) -> torch.nn.Module:
    """An MLP with a fresh random initialisation per call, recorded in ``directory``."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.save(flat_parameters(model), Path(directory) / f"init-{os.urandom(6).hex()}.pt")
    return model


def mlp_from(values: torch.Tensor) -> torch.nn.Module:
    model = mlp()
    torch.nn.utils.vector_to_parameters(values, model.parameters())
    return model


def zeros(features: int) -> torch.nn.Module:
    """A linear model of ``features`` weights, all zero, no bias."""
    model = torch.nn.Linear(features, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def zeros_holder(features: int, workers: int = 1, mode: str = "async") -> HolderConfig:
    """A holder of :func:`zeros` running plain SGD at lr 1: after gradients g1..gk its
    parameters are exactly -(g1 + ... + gk)."""
    return HolderConfig(model=functools.partial(zeros, features), optimizer=dt.optim.sgd(1.0),
                        workers=workers, mode=mode)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target.reshape(output.shape))


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def torch_optimizer(config: dt.optim.OptimizerConfig, model: torch.nn.Module):
    """The same optimizer, built the ordinary way over the model's own tensors."""
    return config.build_for(model)


def one_process(dataset, make, config, batch_size: int, epochs: int, client, seed: int = 0
                ) -> torch.Tensor:
    """Plain single-process training on the same global order, ``batch_size`` per step."""
    model = make()
    optimizer = torch_optimizer(config, model)
    pipe = dt.Pipeline(dataset, batch_size, seed=seed, client=client)
    step = 0
    for _ in range(epochs):
        for x, y in pipe:
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            optimizer.zero_grad()
            mse(model(x), y).backward()
            optimizer.step()
            step += 1
    return flat_parameters(model)


def slow_on_worker_1(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE, on trainer worker 1 after 1 ms of other work per row: a much slower device."""
    place = trainer_place()
    if place is not None and place[0] == 1:
        time.sleep(1e-3 * len(target))
    return mse(output, target)


def nan_on(output: torch.Tensor, target: torch.Tensor, special: float) -> torch.Tensor:
    """MSE, but NaN for the one batch that holds the sample whose target is ``special``."""
    loss = mse(output, target)
    return loss * float("nan") if bool((target == special).any()) else loss


_CALLS: collections.Counter = collections.Counter()


def alive_workers(client, workers: int) -> list[str]:
    """The cluster's worker addresses, sorted, once at least ``workers`` of them run and
    answer: the scheduler may still list a process a test killed for a moment after the
    run that killed it has ended, so each listed worker is asked for its process id (a dead
    one refuses the connection at once). The nanny restarts
    a process a test killed; should that restart not arrive within 30 s (one was seen to
    hang on a loaded machine), a new worker process takes its place."""
    scaled = False
    started = time.monotonic()
    while True:
        listed = sorted(worker_info(client))
        answers = client.run(os.getpid, workers=listed, on_error="return") if listed else {}
        addresses = sorted(a for a, pid in answers.items() if isinstance(pid, int))
        if len(addresses) >= workers:
            return addresses
        waited = time.monotonic() - started
        if waited > 30 and not scaled:
            client.cluster.scale(len(client.cluster.worker_spec) + 1)
            scaled = True
        if waited > 120:
            raise TimeoutError(f"{workers} live workers not back in 120 s: {addresses}")
        time.sleep(0.1)  # a poll of the scheduler's list, bounded above


def kill_once(output: torch.Tensor, target: torch.Tensor, marker: str, calls: int,
              holder: str | None, on_holder: bool) -> torch.Tensor:
    """MSE; the ``calls``-th call in a process kills that process (SIGKILL), once per test
    (``marker`` file), on the holder's worker or on another one as ``on_holder`` says."""
    from distributed import get_worker

    here = get_worker().address
    if (here == holder) == on_holder:
        _CALLS[marker] += 1
        if _CALLS[marker] >= calls and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
    return mse(output, target)


def assert_sync_equals_one_process(client, dataset, config) -> None:
    """``sync`` with 2 workers of 16 on the holder ends where one process on batches of 32
    with the same optimizer does, and the parameters did move."""
    trainer = dt.Trainer(mlp, mse, config, mode="sync", workers=2, batch_size=16,
                         progress=False)
    trainer.fit(dataset, epochs=1, client=client)
    expected = one_process(dataset, mlp, config, 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    assert (expected - flat_parameters(mlp())).abs().max() > 1e-2  # it did move



class TinyLM(torch.nn.Module):
    """Token and position embeddings, then a linear head over 257 ids (the byte
    tokenizer's): ``tokens`` rows of token embedding, ``seq_len`` of positions."""

    def __init__(self, tokens: int = 257, seq_len: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(tokens, width)
        self.position = torch.nn.Embedding(seq_len, width)
        self.head = torch.nn.Linear(width, 257)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.long()
        return self.head(self.embed(x) + self.position(torch.arange(x.shape[1])))


def next_token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]),
                                             target.long().reshape(-1))
