"""An S3 server for tests: moto's S3 server on 127.0.0.1, and a proxy that throttles.

:class:`MotoS3Server` runs moto's S3 server on a free port in a child process;
a server stopped and started again on the same port starts empty, like a
replaced one (a test gives each store a fresh bucket).
:class:`ThrottlingProxy` forwards HTTP to it and, on request, answers the next
requests itself with ``503 SlowDown``, as S3 does under too high a request
rate. :func:`aws_test_environment` is the environment a client needs: test
credentials and a region, and no shared config files or instance metadata.
Tests stop every server they start (a fixture's teardown).
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import botocore.config

from tests.support.redis_server import free_port

START_TIMEOUT_S = 10.0
REGION = "us-east-1"


def aws_test_environment() -> dict[str, str]:
    """Variables that give the AWS chain test credentials, a region and nothing else."""
    return {
        "AWS_ACCESS_KEY_ID": "kvtier-test-access-key",
        "AWS_SECRET_ACCESS_KEY": "kvtier-test-secret-key",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": "/nonexistent/kvtier-test-aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/kvtier-test-aws-credentials",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class MotoS3Server:
    """moto's S3 server in a child process on 127.0.0.1, started by :meth:`start`.

    A child process rather than moto's threaded server in this one: the server
    imports Flask, whose request-bound proxies break code that inspects every
    loaded module (vLLM's CPU platform does, at engine start-up), and a server
    sharing this interpreter takes its lock from the code under test.
    """

    def __init__(self, *, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3Server:
        """Start the server, empty, and wait until the port accepts connections."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"moto's S3 server on port {self.port} exited with {code}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto's S3 server on port {self.port} did not start"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server if it runs; it loses every bucket and object. Idempotent."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def client(self) -> Any:
        """A boto3 S3 client of this server, with test credentials."""
        environment = aws_test_environment()
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(s3={"addressing_style": "path"}),
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name``; return the name."""
        self.client().create_bucket(Bucket=name)
        return name


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read counters, not logs."""

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.server.take_throttle(self.command, self.path):
            reply = (
                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>"
            )
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", port), _Forward)
        self.upstream_port = upstream_port
        self.throttled = 0
        self.requests: list[str] = []
        self._throttle = 0
        self._refused: tuple[str, str] | None = None
        self._lock = threading.Lock()

    def take_throttle(self, method: str, path: str) -> bool:
        with self._lock:
            self.requests.append(method)
            refused = self._refused
            if refused is not None and method == refused[0] and path.endswith(refused[1]):
                self.throttled += 1
                return True
            if self._throttle == 0:
                return False
            self._throttle -= 1
            self.throttled += 1
            return True

    def throttle(self, requests: int) -> None:
        with self._lock:
            self._throttle = requests

    def refuse(self, method: str, path_end: str) -> None:
        with self._lock:
            self._refused = (method, path_end)


class ThrottlingProxy:
    """Forwards HTTP on 127.0.0.1 to a server; :meth:`throttle` makes it answer 503 SlowDown."""

    def __init__(self, upstream_port: int) -> None:
        self.port = free_port()
        self._server = _ProxyServer(self.port, upstream_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvtier-test-s3-proxy", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def throttled(self) -> int:
        """Requests answered with 503 so far."""
        return self._server.throttled

    @property
    def requests(self) -> list[str]:
        """The method of every request received so far, in order."""
        return self._server.requests

    def throttle(self, requests: int) -> None:
        """Answer the next ``requests`` requests with ``503 SlowDown`` (0 stops it)."""
        self._server.throttle(requests)

    def refuse(self, method: str, path_end: str) -> None:
        """Answer every ``method`` request whose path ends with ``path_end`` with ``503
        SlowDown``, from now on."""
        self._server.refuse(method, path_end)

    def stop(self) -> None:
        """Stop forwarding and close the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
