"""A real S3 server for the tests: moto's S3 on 127.0.0.1, in its own process.

``python -m tests.s3_server`` binds a free port, prints ``port <N>`` and serves until
killed. A WSGI wrapper counts what the server does, so tests measure the traffic of
every client process (ranks of a torchrun world included), not what one client
believes it sent: ``GET /_elastor/counters`` returns the body bytes served for object
GETs, the number of PUTs and the most PUTs in flight at once.

``S3Server`` (the pytest side) starts it, creates an IAM user and a bucket, then turns
on moto's request authentication, so wrong credentials fail as on AWS.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

COUNTERS_PATH = "/_elastor/counters"


class CountingApp:
    """WSGI middleware: counts object GET body bytes and concurrent PUTs."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counters = {"get_body_bytes": 0, "gets": 0, "puts": 0, "max_puts_in_flight": 0}
        self.puts_in_flight = 0

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if path == COUNTERS_PATH:
            with self.lock:
                body = json.dumps(self.counters).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        if method == "PUT":
            with self.lock:
                self.puts_in_flight += 1
                self.counters["puts"] += 1
                self.counters["max_puts_in_flight"] = max(
                    self.counters["max_puts_in_flight"], self.puts_in_flight)
            try:
                return list(self.app(environ, start_response))
            finally:
                with self.lock:
                    self.puts_in_flight -= 1
        if method != "GET" or "/moto-api" in path:
            return self.app(environ, start_response)
        status = []

        def record(code, headers, exc_info=None):
            status.append(code)
            return start_response(code, headers, exc_info)

        body = list(self.app(environ, record))
        if status and status[0][:3] in ("200", "206") and "list-type" not in \
                environ.get("QUERY_STRING", ""):
            with self.lock:
                self.counters["gets"] += 1
                self.counters["get_body_bytes"] += sum(len(b) for b in body)
        return body


def serve() -> None:
    """Serve moto's S3 behind ``CountingApp`` on a free loopback port."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs) -> None:
            pass

    server = make_server("127.0.0.1", 0, CountingApp(DomainDispatcherApplication(
        create_backend_app)), threaded=True, request_handler=Quiet)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


@dataclass
class S3Server:
    """A running server and the AWS environment that reaches it."""

    process: subprocess.Popen
    endpoint: str
    env: dict[str, str]
    """``AWS_ENDPOINT_URL``, ``AWS_REGION`` and a valid key pair of an IAM user."""

    @staticmethod
    def start(bucket: str, repo: Path) -> "S3Server":
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.s3_server"], cwd=repo, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": str(repo)})
        line = process.stdout.readline()
        if not line.startswith("port "):
            process.kill()
            raise RuntimeError(f"the moto S3 server did not start: {line!r}")
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": "bootstrap", "AWS_SECRET_ACCESS_KEY": "bootstrap"}
        server = S3Server(process, endpoint, env)
        try:
            server._bootstrap(bucket)
        except Exception:
            server.stop()
            raise
        return server

    def _bootstrap(self, bucket: str) -> None:
        """Bucket, an IAM user allowed all of S3 with its key pair in ``env``, then
        authentication on (moto accepts anything until it is turned on)."""
        import boto3
        import requests

        session = boto3.session.Session(
            aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
            region_name="us-east-1")
        session.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=bucket)
        iam = session.client("iam", endpoint_url=self.endpoint)
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        self.env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"],
                        AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        requests.post(f"{self.endpoint}/moto-api/reset-auth", data=b"0",
                      timeout=10).raise_for_status()

    def counters(self) -> dict[str, int]:
        import requests

        return requests.get(self.endpoint + COUNTERS_PATH, timeout=10).json()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        self.process.stdout.close()


@contextlib.contextmanager
def s3_environment(bucket: str, repo: Path) -> Iterator[S3Server]:
    """A server with ``bucket``, its endpoint and an IAM user's keys in this process's
    environment (and so in every process started meanwhile), restored on exit."""
    server = S3Server.start(bucket, repo)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


if __name__ == "__main__":
    serve()
