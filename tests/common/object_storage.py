"""A real S3 server (moto) on 127.0.0.1 for the object-storage tests, and its options.

``from tests.common.object_storage import s3_server`` makes the fixture ``s3`` (one server
per module) available in a test module; its tests are skipped where moto or s3fs is not
installed.
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.request

import pytest

BUCKET = "dasktrain-tests"


@dataclasses.dataclass
class S3:
    options: dict
    fs: object

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}"

    def names(self, name: str) -> list[str]:
        """What lies directly under ``s3://BUCKET/name``."""
        self.fs.invalidate_cache()
        path = f"{BUCKET}/{name}"
        return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(path)) \
            if self.fs.exists(path) else []

    def chunk_objects(self, name: str) -> int:
        self.fs.invalidate_cache()
        return sum("/c/" in p for p in self.fs.find(f"{BUCKET}/{name}"))

    def cli_options(self) -> list[str]:
        return [arg for key, value in self.options.items()
                for arg in ("--storage-option", f"{key}={value}")]


@pytest.fixture(scope="module", name="s3")
def s3_server():
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        # moto keeps its buckets in process-wide state, which a server started by another
        # module of this session still holds: start from an empty store.
        reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
        urllib.request.urlopen(reset, timeout=10).close()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing",
                   "secret": "testing"}
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield S3(options, fs)
    finally:
        server.stop()
