"""A local S3 server for the tests and the bench scripts: moto's server mode (`moto_server`, pip install
'moto[server]'), on 127.0.0.1 on a port the kernel picked, stopped by its PID. Nothing leaves the loopback; the
credentials are dummies that the server accepts (unless started with `check_credentials`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from processes import free_port, kill_tree

_GET = re.compile(r'"(?:\x1b\[[\d;]*m)*GET /([^ ?]+) HTTP')  # a request line of the log (colours and all)


class S3Server:
    """`moto_server` running; `env` points an S3 client at it (dummy keys, AWS_ENDPOINT_URL)."""

    def __init__(self, log: Path, check_credentials: bool = False, timeout: float = 60):
        self.port, self.log = free_port(), log
        self.endpoint = f"http://127.0.0.1:{self.port}"
        server = Path(sys.executable).with_name("moto_server")
        environ = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {})}
        with log.open("a") as out:
            self.process = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(self.port)], stdout=out,
                                            stderr=subprocess.STDOUT, env=environ)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}: {log.read_text()[-2000:]}")
                time.sleep(0.05)  # polling the port, with the deadline above

    @property
    def env(self) -> dict[str, str]:
        """An S3 client's settings for this server; no instance metadata lookup (no network beyond loopback)."""
        return {"AWS_ACCESS_KEY_ID": "meshtune-test", "AWS_SECRET_ACCESS_KEY": "meshtune-test-secret",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def object_reads(self, prefix: str) -> Counter:
        """How many times the server was asked for each object under `prefix` (GETs of the object, by its name
        relative to the prefix; listings are not counted), from its request log."""
        reads: Counter = Counter()
        for line in self.log.read_text(errors="replace").splitlines():
            match = _GET.search(line)
            if match and match.group(1).startswith(prefix.rstrip("/") + "/"):
                reads[match.group(1)[len(prefix.rstrip("/")) + 1:]] += 1
        return reads

    def make_bucket(self, name: str) -> None:
        client(self).mkdir(name)

    def stop(self) -> None:
        kill_tree(self.process.pid)
        self.process.wait(timeout=30)


def client(server: S3Server):
    """An s3fs filesystem on `server`, for a test or a bench script to look into the bucket."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=server.endpoint, key=server.env["AWS_ACCESS_KEY_ID"],
                             secret=server.env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                             use_listings_cache=False)
