"""Forward passes begun while a reply still arrives: each module waits for the buckets of
its own tensors, a receiver's failure fails the forward, the first computation is checked
for tensors read outside their module's forward, and whole trainings stay exact."""

from __future__ import annotations

import threading

import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.errors import HolderLost
from dasktrain.trainer.exchange.arrival import Arrival
from dasktrain.trainer.exchange.buckets import bucket_order, reply_order
from dasktrain.trainer.flat import FlatModel
from dasktrain.trainer.worker.gate import ForwardGate
from tests.common.training import flat_parameters, mse, one_process


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


class _ReadsChildWeight(torch.nn.Module):
    """Its own forward uses its last layer's weight directly: outside that layer's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.body(x), self.head.weight, self.head.bias)


def _gated(model: torch.nn.Module) -> tuple[FlatModel, ForwardGate, list, tuple]:
    flat = FlatModel(model)
    order = reply_order(bucket_order(flat.layout, flat.layout.size, bucket_bytes=1))
    current: list[Arrival | None] = [None]
    return flat, ForwardGate(flat.model, flat.tensors, order, lambda: current[0]), current, order


def test_each_module_waits_for_the_buckets_of_its_own_tensors():
    flat, _, current, order = _gated(_mlp())
    linears = [m for m in flat.model if isinstance(m, torch.nn.Linear)]
    assert len(order) == 2 * len(linears)  # a weight, a bias: the first layer's first
    needs = [2 * i + 1 for i in range(len(linears))]  # the last bucket of each layer
    arrival = current[0] = Arrival(len(order), "a test reply", timeout=30)
    log: list[str] = []
    lock = threading.Lock()
    began = [threading.Event() for _ in linears]
    for i, layer in enumerate(linears):  # runs after the gate's own hook has let it through
        def note(module, args, i=i):
            with lock:
                log.append(f"forward {i}")
            began[i].set()
        layer.register_forward_pre_hook(note)

    def land() -> None:
        for bucket in range(len(order)):
            for i, need in enumerate(needs):  # layers that can compute have begun to
                if need < bucket:
                    assert began[i].wait(30)
            with lock:
                log.append(f"landed {bucket}")
            arrival.landed(bucket)

    lander = threading.Thread(target=land)
    lander.start()
    out = flat.model(torch.randn(8, 4))
    lander.join(30)
    assert out.shape == (8, 1)
    for i, need in enumerate(needs):  # never a layer's forward before its buckets landed
        assert log.index(f"landed {need}") < log.index(f"forward {i}")
    # and each began as soon as it could, while later buckets were still to land
    assert log[:3] == ["landed 0", "landed 1", "forward 0"]


def test_a_reply_that_fails_to_arrive_fails_the_forward_with_its_error():
    flat, _, current, order = _gated(_mlp())
    arrival = current[0] = Arrival(len(order), "a test reply", timeout=30)
    arrival.landed(0)
    arrival.failed(HolderLost("the parameter holder's worker died"))
    with pytest.raises(HolderLost, match="died"):
        flat.model(torch.randn(8, 4))


def test_the_first_computation_is_checked_for_tensors_read_outside_their_module():
    for model, safe in ((_mlp(), True), (_ReadsChildWeight(), False)):
        flat, gate, _, _ = _gated(model)
        with gate.check():
            mse(flat.model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
        assert gate.verified is safe


def test_a_model_that_takes_no_module_hooks_is_left_without_any():
    scripted = torch.jit.script(_mlp())
    flat = FlatModel(scripted)
    order = reply_order(bucket_order(flat.layout, flat.layout.size, bucket_bytes=1))
    with pytest.raises(RuntimeError, match="not supported on ScriptModules"):
        ForwardGate(flat.model, flat.tensors, order, lambda: None)


@pytest.mark.parametrize("make", [_mlp, _ReadsChildWeight], ids=["modules", "reads-child"])
def test_sync_with_replies_streamed_equals_one_process(client, regression, make):
    config = dt.optim.sgd(0.05, momentum=0.9)
    trainer = dt.Trainer(make, mse, config, mode="sync", workers=2, batch_size=16,
                         bucket_bytes=1, shared_memory=False, progress=False)
    history = trainer.fit(regression, epochs=2, client=client)
    streamed = sorted(w["replies_streamed"] for w in history.epochs[-1]["per_worker"])
    # The worker beside the holder gets its replies in place; the other one receives them
    # bucket by bucket, unless its model reads a tensor outside its module's forward.
    assert streamed == [False, make is _mlp]
    expected = one_process(regression, make, config, 32, 2, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
