"""The paths between hosts, on two hosts of this machine (network namespaces, see
:mod:`dasktrain._hosts` and :mod:`tests.common.hosts`): host A runs the scheduler, two worker
processes and the driver (where the functions ``_on_...`` below run), host B two worker
processes.

The channel takes TCP between hosts and memory shared with the holder, or its local socket,
within one; shards go to both hosts and train as one holder does; a host whose processes all
die is survived as a dead worker is; and a dataset and checkpoint on object storage (a moto
server on host A's address) are read and written from both hosts.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import dasktrain as dt
import dasktrain._hosts
from dasktrain._cluster import worker_info
from tests.common.builders import wait_for
from tests.common.hosts import (  # noqa: F401  (the two_hosts fixture)
    kill_host_once,
    start_hosts,
    two_hosts_fixture,
)
from tests.common.training import flat_parameters, mlp, mse

BUCKET = "dasktrain-hosts"


def _first_worker_on(client, address: str) -> str:
    """The first Dask worker of the host at ``address``: the holder goes there."""
    return sorted(w for w in worker_info(client) if w.startswith(f"tcp://{address}:"))[0]


def _trainer(loss=mse, **options) -> dt.Trainer:
    return dt.Trainer(mlp, loss, dt.optim.sgd(0.05, momentum=0.9), mode="sync", workers=4,
                      batch_size=8, progress=False, **options)


def _on_prepare(client, path: str) -> str:
    dt.prepare("regression", path, client=client, samples=320, width=4, chunk_rows=80,
               seed=5, progress=False)
    return path


@pytest.fixture(scope="module")
def data(two_hosts, tmp_path_factory) -> str:
    """A small regression dataset on local disk, which both hosts see."""
    path = str(tmp_path_factory.mktemp("hosts-data") / "reg.zarr")
    return two_hosts.run(_on_prepare, path)


# -- the hosts -----------------------------------------------------------------------------
def _loopback_port() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener, listener.getsockname()[1]


def _reaches(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _on_who_is_where(client) -> dict:
    listener, port = _loopback_port()  # on host A's loopback
    with listener:
        return {"driver": socket.gethostname(),
                "names": client.run(socket.gethostname),
                "reach_driver_loopback": client.run(_reaches, port)}


def test_each_host_has_its_own_name_address_and_loopback(two_hosts):
    found = two_hosts.run(_on_who_is_where)
    a, b = two_hosts.a, two_hosts.b
    assert found["driver"] == a.name and a.name != b.name
    assert (a.address, b.address) == ("192.0.2.1", "192.0.2.2")
    assert sorted(found["names"].values()) == [a.name, a.name, b.name, b.name]
    for address, name in found["names"].items():
        assert two_hosts.host_of(address).name == name
        # 127.0.0.1 is each host's own: the driver's port there is reached from A only.
        assert found["reach_driver_loopback"][address] == (name == a.name)


def _in_namespaces(inodes: set[int]) -> list[int]:
    """The processes in the network namespaces of these inode numbers."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    found.append(int(entry))
            except OSError:  # gone meanwhile
                continue
    return found


def _namespaces(hosts) -> set[int]:
    return {os.stat(f"/proc/{host.keeper}/ns/net").st_ino for host in hosts}


def test_closed_hosts_leave_nothing_behind():
    hosts = start_hosts(2)
    try:
        inodes = _namespaces(hosts)
        for host in hosts:
            hosts.popen(host, [sys.executable, "-c", "import time; time.sleep(600)"])
        # A keeper and a sleeper on each host (once nsenter took it there).
        wait_for(lambda: len(_in_namespaces(inodes)) == 4, 30, "a process on each host")
    finally:
        hosts.close()
    # Nothing is left on the hosts, and so the kernel removed the namespaces and links.
    assert _in_namespaces(inodes) == []


def test_a_limited_link_is_limited_at_both_ends_and_a_bad_rate_is_named():
    hosts = start_hosts(2)
    try:
        hosts.limit_rate("300mbit")
        ends = [(hosts[0], "port1"), (hosts[1], dasktrain._hosts.INTERFACE)]
        for host, device in ends:
            shown = subprocess.run(host.command(["tc", "qdisc", "show", "dev", device]),
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in shown and "rate 300Mbit" in shown, shown
        with pytest.raises(ValueError, match="cannot limit the links to 'fast'"):
            hosts.limit_rate("fast")
    finally:
        hosts.close()


# Makes two hosts with a process on each, says which, and waits to be killed. It loads
# dasktrain/_hosts.py alone: the package's imports would take seconds.
_MAKER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("hosts", sys.argv[1])
hosts_module = sys.modules["hosts"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hosts_module)
hosts = hosts_module.Hosts(2).start()
for host in hosts:
    hosts.popen(host, [sys.executable, "-c", "import time; time.sleep(600)"])
print(json.dumps([os.stat(f"/proc/{h.keeper}/ns/net").st_ino for h in hosts]), flush=True)
sys.stdin.read()
"""


def test_the_hosts_of_a_killed_process_end_with_it():
    start_hosts(1).close()  # skips where there are none
    maker = subprocess.Popen([sys.executable, "-c", _MAKER, dasktrain._hosts.__file__],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        inodes = set(json.loads(maker.stdout.readline()))
        wait_for(lambda: len(_in_namespaces(inodes)) == 4, 30, "a process on each host")
        os.kill(maker.pid, signal.SIGKILL)  # no cleanup of its own runs
        wait_for(lambda: not _in_namespaces(inodes), 30, "the hosts to be gone")
    finally:
        maker.kill()
        maker.communicate(timeout=30)


# -- the exchange between hosts --------------------------------------------------------------
def _on_fit_transports(client, data: str, host_a: str) -> dict:
    holder = _first_worker_on(client, host_a)
    found = {}
    for name, options in {"shared": {}, "socket": {"shared_memory": False}}.items():
        history = _trainer(holder_worker=holder, **options).fit(data, epochs=1,
                                                                 client=client)
        epoch = history.epochs[0]
        found[name] = {"holder": holder, "via": epoch["exchange_via"],
                       "transports": {w["address"]: w["transport"]
                                      for w in epoch["per_worker"]}}
    return found


def test_the_channel_takes_tcp_between_hosts_and_memory_or_local_socket_within_one(
        two_hosts, data):
    found = two_hosts.run(_on_fit_transports, data, two_hosts.a.address)
    for name, within in {"shared": "shared", "socket": "local"}.items():
        run = found[name]
        assert run["via"] == {"local": 1, "direct": 3}
        by_host: dict[str, list] = {}
        for address, transport in run["transports"].items():
            expected = (None if address == run["holder"] else
                        within if two_hosts.host_of(address) == two_hosts.a else "tcp")
            assert transport == expected, (name, address, run)
            by_host.setdefault(two_hosts.host_of(address).name, []).append(transport)
        assert sorted(by_host) == [two_hosts.a.name, two_hosts.b.name]


def _on_fit_shards(client, data: str) -> dict:
    found = {}
    for shards in (2, 1):
        trainer = _trainer(holder_shards=shards)
        epoch = trainer.fit(data, epochs=1, client=client).epochs[0]
        found[shards] = {"via": epoch["exchange_via"],
                         "transports": {w["address"]: w["transport"]
                                        for w in epoch["per_worker"]},
                         "parameters": flat_parameters(trainer.model)}
    return found


def test_holder_shards_go_to_both_hosts_and_train_as_one_holder(two_hosts, data):
    found = two_hosts.run(_on_fit_shards, data)
    sharded = found[2]
    # Each shard is in the process of one trainer worker, which reaches the other over TCP.
    assert sharded["via"] == {"shards:direct+local": 2, "shards:direct": 2}
    by_host: dict[str, list] = {}
    for address, transport in sharded["transports"].items():
        by_host.setdefault(two_hosts.host_of(address).name, []).append(transport)
    # On each host, one worker shares memory with the shard there and reaches the other
    # host's over TCP: a shard on each host.
    assert {name: sorted(t) for name, t in by_host.items()} == {
        two_hosts.a.name: ["shared+tcp", "tcp"], two_hosts.b.name: ["shared+tcp", "tcp"]}
    torch.testing.assert_close(sharded["parameters"], found[1]["parameters"], rtol=1e-5,
                               atol=1e-6)
    assert (sharded["parameters"] - flat_parameters(mlp())).abs().max() > 1e-2


# -- a host dies -----------------------------------------------------------------------------
def _on_fit_killing_host(client, data: str, host_a: str, marker: str, hostname: str) -> dict:
    loss = functools.partial(kill_host_once, marker=marker, calls=5, hostname=hostname)
    trainer = _trainer(loss, holder_worker=_first_worker_on(client, host_a))
    started = time.monotonic()
    history = trainer.fit(data, epochs=2, client=client)
    return {"seconds": time.monotonic() - started,
            "epochs": [e["epoch"] for e in history.epochs],
            "events": history.events, "contributors": history.contributors,
            "last_epoch_on": [w["address"] for w in history.epochs[-1]["per_worker"]],
            "finite": bool(torch.isfinite(flat_parameters(trainer.model)).all())}


def test_a_host_whose_processes_all_die_is_survived_as_a_dead_worker_is(two_hosts, data,
                                                                        tmp_path):
    a, b = two_hosts.a, two_hosts.b
    marker = tmp_path / "killed"
    try:
        found = two_hosts.run(_on_fit_killing_host, data, a.address, str(marker), b.name)
        assert marker.exists()  # host B's processes really died, in epoch 0
        assert two_hosts.hosts.processes(b) == []
    finally:  # host B back for the module's other tests
        two_hosts.cluster.kill_workers(1)
        two_hosts.cluster.start_workers(1)
    assert found["seconds"] < 120
    assert found["epochs"] == [0, 1] and found["finite"]
    # Workers 2 and 3 trained on host B: each dropped at the barrier, or its rerun task
    # rejoined on host A.
    for w in (2, 3):
        assert any(f"worker {w} dropped" in e or f"worker {w} rejoined" in e
                   for e in found["events"]), found["events"]
    assert found["contributors"].count(4) >= 4  # the steps before host B died
    assert {two_hosts.host_of(address) for address in found["last_epoch_on"]} == {a}


# -- object storage --------------------------------------------------------------------------
def _read_rows(url: str, options: dict) -> tuple[str, float]:
    """This host's name and the sum of the dataset's features, read from object storage."""
    ds = dt.open_dataset(url, storage_options=options)
    return socket.gethostname(), float(ds.zarr_array(ds.features_name)[:].sum(dtype="f8"))


def _on_object_storage(client, host_a: str) -> dict:
    import logging

    import fsspec
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=host_a, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing",
                   "secret": "testing"}
        s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(BUCKET)
        url, run = f"s3://{BUCKET}/reg.zarr", f"s3://{BUCKET}/run"
        # Written by the workers of both hosts, read by each of them.
        dt.prepare("regression", url, client=client, storage_options=options, samples=320,
                   width=4, chunk_rows=160, seed=5, progress=False)
        read = client.run(_read_rows, url, options)
        fsspec.config.conf["s3"] = dict(options)  # the checkpoint's URL alone
        try:
            trainer = _trainer()
            history = trainer.fit(dt.open_dataset(url, storage_options=options), epochs=1,
                                  client=client, checkpoint=run)
            saved = sorted(p.rsplit("/", 1)[-1] for p in fsspec.filesystem("s3").ls(run))
        finally:
            del fsspec.config.conf["s3"]
        return {"endpoint": options["endpoint_url"], "here": _read_rows(url, options),
                "read": read, "saved": saved,
                "trained_on": [w["address"] for w in history.epochs[0]["per_worker"]]}
    finally:
        server.stop()


def test_object_storage_is_read_and_written_from_every_host(two_hosts):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    a, b = two_hosts.a, two_hosts.b
    found = two_hosts.run(_on_object_storage, a.address)
    assert found["endpoint"].startswith(f"http://{a.address}:")
    here_name, rows = found["here"]
    assert here_name == a.name
    assert sorted(name for name, _ in found["read"].values()) == [a.name, a.name, b.name,
                                                                  b.name]
    assert {total for _, total in found["read"].values()} == {rows}
    assert found["saved"] == ["checkpoint-updates.jsonl", "checkpoint.pt"]
    assert {two_hosts.host_of(address) for address in found["trained_on"]} == {a, b}

