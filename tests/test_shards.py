"""The holder in shards: slices of whole tensors that tile the payload, shards spread over
hosts, settings shards cannot honour refused by name, and on a real cluster: ``sync`` in
shards equal to one process (SGD with momentum), and to one holder with LARS's per-tensor
trust ratios, Adam, parameter groups and batch-norm buffers; a non-finite gradient refused by
every shard; a checkpoint that resumes only with the same number of shards; the shards'
answers awaited together, so that any shard's dead worker ends the wait at once. Killed
processes under training are in tests/test_trainer_failures.py."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dasktrain as dt
from dasktrain._cluster import worker_info
from dasktrain.trainer.exchange.sharded import HolderShards
from dasktrain.trainer.flat import FlatLayout
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from dasktrain.trainer.holder.shards import check_shards, shard_layouts, shard_workers
from tests.common.training import flat_parameters, mlp, mse, nan_on, one_process


def _net(norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
              torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    if norm:
        layers.insert(1, torch.nn.BatchNorm1d(16))
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_shards_are_runs_of_whole_tensors_that_tile_the_payload(shards):
    layout = FlatLayout.of(_net(norm=True))
    parts = shard_layouts(layout, shards)
    assert len(parts) == shards
    assert parts[0][0][0] == 0 and parts[-1][0][1] == layout.size
    tensors = []
    for k, ((start, stop), part) in enumerate(parts):
        assert part.params and stop - start == part.size
        if k:
            assert start == parts[k - 1][0][1]
        tensors += list(part.params)
        # Only the last shard keeps the buffers (they come after every parameter).
        assert part.buffers == (layout.buffers if k == shards - 1 else ())
    assert tuple(tensors) == layout.params
    n = len(layout.params)
    with pytest.raises(ValueError, match=f"between 1 and the model's {n} parameter tensors"):
        shard_layouts(layout, n + 1)


def test_shards_are_about_equal_in_size():
    layout = FlatLayout.of(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]))
    sizes = [stop - start for (start, stop), _ in shard_layouts(layout, 2)]
    assert sizes == [layout.size // 2] * 2


def test_shards_go_to_one_worker_per_host_in_turn():
    workers = ["tcp://10.0.0.2:1", "tcp://10.0.0.2:2", "tcp://10.0.0.1:5",
               "tcp://10.0.0.3:7", "tcp://10.0.0.1:6"]
    assert shard_workers(workers, 3) == ["tcp://10.0.0.1:5", "tcp://10.0.0.2:1",
                                         "tcp://10.0.0.3:7"]
    assert shard_workers(workers, 4) == ["tcp://10.0.0.1:5", "tcp://10.0.0.2:1",
                                         "tcp://10.0.0.3:7", "tcp://10.0.0.1:6"]
    # The worker asked for takes shard 0; the others go to the hosts after its own.
    assert shard_workers(workers, 2, first="tcp://10.0.0.2:2") == [
        "tcp://10.0.0.2:2", "tcp://10.0.0.3:7"]
    # ...and its host has a shard already: the next goes to another host.
    assert shard_workers(workers, 3, first="tcp://10.0.0.1:5") == [
        "tcp://10.0.0.1:5", "tcp://10.0.0.2:1", "tcp://10.0.0.3:7"]
    with pytest.raises(ValueError, match="needs as many workers"):
        shard_workers(workers, 6)


@pytest.mark.parametrize("options, message", [
    ({"holder_shards": 0}, "positive integer"),
    ({"holder_shards": 2, "mode": "async"}, "needs mode='sync'"),
    ({"holder_shards": 2, "clip_grad_norm": 1.0}, "whole gradient's norm"),
])
def test_settings_shards_cannot_honour_are_refused_by_name(options, message):
    mode = options.pop("mode", "sync")
    with pytest.raises(ValueError, match=message):
        dt.Trainer(_net, mse, dt.optim.sgd(0.1), mode=mode, workers=2, batch_size=8,
                   progress=False, **options)
    check_shards(1, "async", 1.0)  # one holder: anything goes


@pytest.mark.parametrize("direct", [True, False])
def test_sync_in_shards_equals_one_process(client, regression, direct):
    config = dt.optim.sgd(0.05, momentum=0.9)
    trainer = dt.Trainer(_net, mse, config, mode="sync", workers=2, batch_size=16,
                         holder_shards=2, direct_channel=direct, progress=False)
    history = trainer.fit(regression, epochs=2, client=client)
    # Each worker has one shard in its process and the other over the channel, or
    # through the actor's calls, whose replies are arrays of their own.
    via = "shards:direct+local" if direct else "shards:actor+local"
    assert history.epochs[0]["exchange_via"] == {via: 2}
    expected = one_process(regression, _net, config, 32, 2, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    assert len(history.loss) == 20 and history.contributors == [2] * 20


@pytest.mark.parametrize("optimizer", ["lars", "adam", "sgd with groups"])
def test_shards_keep_per_tensor_optimizers_and_buffers_as_one_holder(client, regression,
                                                                      optimizer):
    config = {"lars": dt.optim.lars(0.5, momentum=0.9), "adam": dt.optim.adam(0.01),
              "sgd with groups": dt.optim.sgd(0.05, momentum=0.9, groups=[
                  dt.optim.group("5.*", lr=0.01, weight_decay=0.1)])}[optimizer]
    make = functools.partial(_net, norm=True)
    results = []
    for shards in (1, 2):
        trainer = dt.Trainer(make, mse, config, mode="sync", workers=2, batch_size=16,
                             holder_shards=shards, progress=False)
        trainer.fit(regression, epochs=1, client=client)
        results.append(trainer.model.state_dict())
    for name, value in results[0].items():  # parameters and batch-norm statistics
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6)


def test_a_non_finite_gradient_is_refused_by_every_shard(client, regression):
    special = float(regression.zarr_array(regression.targets_name)[7, 0])
    loss = functools.partial(nan_on, special=special)
    trainer = dt.Trainer(_net, loss, dt.optim.sgd(0.05), mode="sync", workers=2,
                         batch_size=16, holder_shards=2, on_nonfinite="skip", progress=False)
    history = trainer.fit(regression, epochs=1, client=client)
    assert history.refused_gradients == 1
    assert sorted(history.contributors) == [1] + [2] * 9  # the round went on without it
    assert torch.isfinite(flat_parameters(trainer.model)).all()


def test_a_checkpoint_in_shards_resumes_with_as_many_shards(client, regression, tmp_path):
    def trainer(shards):
        return dt.Trainer(_net, mse, dt.optim.sgd(0.05, momentum=0.9), mode="sync",
                          workers=2, batch_size=16, holder_shards=shards,
                          checkpoint_every=3, progress=False)

    straight = trainer(2)
    straight.fit(regression, epochs=2, client=client)
    first = trainer(2)
    first.fit(regression, epochs=1, client=client, checkpoint=tmp_path / "run")
    with pytest.raises(ValueError, match="made by a holder in 2 shards"):
        trainer(1).fit(regression, epochs=2, client=client, resume=tmp_path / "run")
    resumed = trainer(2)
    resumed.fit(regression, epochs=2, client=client, resume=tmp_path / "run")
    torch.testing.assert_close(flat_parameters(resumed.model),
                               flat_parameters(straight.model), rtol=1e-5, atol=1e-6)
    # A fit checkpoint in shards loads as a model like any other.
    loaded = dt.Trainer.load(tmp_path / "run" / "checkpoint.pt", _net)
    torch.testing.assert_close(flat_parameters(loaded.model),
                               flat_parameters(first.model))


def test_a_dead_shard_ends_the_wait_on_another_shards_answer():
    """The driver awaits an answer that shard 0 never gives while shard 1's process is
    killed: HolderLost naming shard 1 within a few liveness slices, not a silence after
    shard 0's whole timeout. A cluster of its own: its worker process is killed."""
    timeout = 30.0
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        addresses = sorted(worker_info(client))
        actors = [client.submit(ParameterHolder,
                                HolderConfig(model=mlp, optimizer=dt.optim.sgd(0.1),
                                             workers=1, shard=(k, 2)),
                                actor=True, workers=[address], pure=False).result(timeout=60)
                  for k, address in enumerate(addresses)]
        shards = HolderShards(actors, timeout, client)
        # No update will ever bring either shard to this version.
        waiting = shards.call("state_at", 10**6)
        pid = client.run(os.getpid, workers=[addresses[1]])[addresses[1]]
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(dt.HolderLost, match=r"shard 1"):
            waiting.result()
        assert time.monotonic() - started < timeout / 3


def test_shards_answering_at_different_updates_say_so(client):
    """A shard asked for a version it has passed answers with its state now; shards a step
    apart then answer with two versions, which the merge names (the driver writes no
    checkpoint of them) instead of passing them off as one model's state."""
    addresses = sorted(worker_info(client))
    actors = [client.submit(ParameterHolder,
                            HolderConfig(model=mlp, optimizer=dt.optim.sgd(0.1), workers=1,
                                         shard=(k, 2)),
                            actor=True, workers=[address], pure=False).result(timeout=60)
              for k, address in enumerate(addresses)]
    shards = HolderShards(actors, 30.0, client)
    together = shards.call("state_at", 0).result()
    assert together["version"] == 0 and "mixed_versions" not in together
    # Shard 0 one update ahead of shard 1, as while a step finishes shard by shard.
    ahead = {**together["shards"][0], "version": 1}
    actors[0].load_state_dict(ahead).result()
    apart = shards.call("state_at", 0).result()
    assert apart["mixed_versions"] == [0, 1]
    assert [int(r["version"]) for r in apart["shards"]] == [1, 0]
