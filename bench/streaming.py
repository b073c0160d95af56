"""Live output through PostgreSQL: chunk-to-browser latency, and fan-out under load.

    python -m bench.streaming [--runs 100] [--rate 200] [--seconds 10] [--sqlite]

Real processes, as in production: one `runworker` (async agents on its loop), one
threaded `runserver` (the web process, WSGI), and this process as the browsers: raw
sockets reading `runs/<id>/events/` as server-sent events. The agent (`tests.stream_bench`)
streams its send time (`time.time()`) as each chunk's text, so every chunk's latency is
its arrival at the socket minus its send time (same machine, same clock).

Rows:
- latency: one run streaming 20 chunks/s for `--seconds`, one open stream: p50/p99/max.
- fan-out: `--runs` runs each streaming `--rate` chunks/s for `--seconds`, one open stream
  each, all in one web process: chunks delivered per second (and the share delivered
  live), the web process's and the worker's database connections (pg_stat_activity by
  application_name, peak over the trial), and the worker's in the same trial without
  streaming (`quiet`), for comparison.

Uses the tests' settings and urls (tests/settings.py: the event stream, sessions, the
bench agent) on a fresh database `<BENCH_DB_PREFIX>_streaming`, dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from bench.pg import PREFIX, REPO_ROOT, Admin, db_url

DB = f"{PREFIX}_streaming"
WEB, WORKER = "bench-stream-web", "bench-stream-worker"


def env(url: str, app: str = "", **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    caps = {"STREAMS_PER_USER": 1000, "STREAMS_PER_PROCESS": 1000}
    return {**os.environ, "DATABASE_URL": url + (f"?application_name={app}" if app else ""),
            "DJANGO_SETTINGS_MODULE": "tests.settings", "AGENTRUNS_TEST_SUBPROCESS": "1",
            "AGENTRUNS_TEST_SETTINGS": json.dumps(caps), "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1", **extra}


def django(url: str, *args: str, app: str = "", wait: bool = True) -> Any:
    command = [sys.executable, "-m", "django", *args]
    if wait:
        return subprocess.run(command, env=env(url, app), cwd=REPO_ROOT, check=True,
                              capture_output=True, text=True)
    return subprocess.Popen(command, env=env(url, app), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def python(url: str, code: str) -> str:
    return str(django(url, "shell", "-c", code).stdout.strip().splitlines()[-1])


@contextmanager
def processes(url: str, concurrency: int) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    web = django(url, "runserver", f"127.0.0.1:{port}", "--noreload", "--skip-checks",
                 app=WEB, wait=False)
    worker = django(url, "runworker", "--concurrency", str(concurrency), app=WORKER,
                    wait=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield port
    finally:
        for process in (web, worker):
            process.terminate()
        for process in (web, worker):
            with suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()


class Streams:
    """Many SSE responses on raw sockets, read by one selector thread."""

    def __init__(self, port: int, session: str, run_ids: list[int]) -> None:
        self.latencies: list[float] = []
        self.chunks = 0
        self.ended = 0
        self.ready = 0  # streams that got their first stored event (caught up, subscribed)
        self._selector = selectors.DefaultSelector()
        self._buffers: dict[socket.socket, bytes] = {}
        for run_id in run_ids:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(f"GET /agentruns/runs/{run_id}/events/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Cookie: sessionid={session}\r\nConnection: close\r\n\r\n".encode())
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
            self._buffers[sock] = b""
        self._open = len(run_ids)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self._open:
            for key, _ in self._selector.select(1.0):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                data = sock.recv(1 << 20)
                now = time.time()
                if not data:
                    self._selector.unregister(sock)
                    sock.close()
                    self._open -= 1
                    continue
                buffer = self._buffers[sock] + data
                *blocks, self._buffers[sock] = buffer.split(b"\n\n")
                for block in blocks:
                    self._block(block.decode(), now)

    def _block(self, block: str, now: float) -> None:
        if block.startswith("id: 1\n"):
            self.ready += 1
        if block.startswith("event: end"):
            self.ended += 1
        if not block.startswith("event: chunk"):
            return
        data = json.loads(block.split("data: ", 1)[1])
        for stamp in data["text"].split(";")[:-1]:
            self.chunks += 1
            self.latencies.append(now - float(stamp))


def trial(url: str, runs: int, rate: float, seconds: float, quiet: bool = False
          ) -> dict[str, float]:
    admin = Admin()
    session = python(url, "from django.contrib.auth.models import User; "
                          "from django.test import Client; c = Client(); "
                          "u = User.objects.filter(username='bench').first() or "
                          "User.objects.create_superuser('bench', '', 'pw'); "
                          "c.force_login(u); print(c.cookies['sessionid'].value)")
    with processes(url, runs) as port:
        time.sleep(1.0)  # the worker is up and idle
        # The runs start streaming together, once every stream is open and subscribed.
        ids, start_at = json.loads(python(url, (
            "import json, time; from django_agentruns import enqueue_many, RunRequest; "
            f"at = time.time() + 4 + {runs} / 25; "
            f"print(json.dumps([[r.pk for r in enqueue_many([RunRequest('tests.stream_bench', "
            f"{{'rate': {rate}, 'seconds': {seconds}, 'quiet': {quiet}, "
            f"'start_at': at}}) for _ in range({runs})])], at]))")))
        streams = Streams(port, session, ids)
        peak = {WEB: 0, WORKER: 0}  # while the runs stream (streams open, caught up)
        while streams.ended < runs and time.time() < start_at + seconds + 60:
            streaming = streams.ready == runs and start_at <= time.time() <= start_at + seconds
            for app in peak:
                count = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                      "application_name = %s", [app]).fetchone()[0]
                if streaming:
                    peak[app] = max(peak[app], count)
            time.sleep(0.1)
        streams.thread.join(5)
    admin.close()
    expected = runs * int(rate * seconds)
    lat = sorted(streams.latencies) or [float("nan")]
    return {"chunks": streams.chunks, "expected": expected,
            "per_second": streams.chunks / seconds,
            "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "max_ms": 1000 * lat[-1], "web_conns": peak[WEB], "worker_conns": peak[WORKER]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--light-rate", type=float, default=20.0,
                        help="the same runs again at this rate (0: skip)")
    args = parser.parse_args(argv)
    admin = Admin()
    admin.drop(DB)
    admin.execute(f'CREATE DATABASE "{DB}"')
    url = db_url(DB)
    try:
        django(url, "migrate", "--verbosity", "0")
        latency = trial(url, 1, 20.0, args.seconds)
        load = trial(url, args.runs, args.rate, args.seconds)
        light = trial(url, args.runs, args.light_rate, args.seconds) if args.light_rate \
            else None
        quiet = trial(url, args.runs, args.rate, args.seconds, quiet=True)
    finally:
        admin.drop(DB)
        admin.close()
    print("| row | figure |\n|---|---|")
    print(f"| chunk-to-browser latency, 1 run x 20 chunks/s (PostgreSQL) | p50 "
          f"{latency['p50_ms']:.1f} ms, p99 {latency['p99_ms']:.1f} ms, max "
          f"{latency['max_ms']:.1f} ms ({latency['chunks']}/{latency['expected']} chunks) |")
    print(f"| {args.runs} runs x {args.rate:g} chunks/s, {args.runs} open streams, one web "
          f"process | {load['per_second']:,.0f} chunks/s delivered "
          f"({load['chunks']:,}/{load['expected']:,}); latency p50 {load['p50_ms']:.1f} ms, "
          f"p99 {load['p99_ms']:.1f} ms |")
    if light is not None:
        print(f"| {args.runs} runs x {args.light_rate:g} chunks/s, {args.runs} open streams, "
              f"one web process | {light['per_second']:,.0f} chunks/s delivered "
              f"({light['chunks']:,}/{light['expected']:,}); latency p50 "
              f"{light['p50_ms']:.1f} ms, p99 {light['p99_ms']:.1f} ms |")
    print(f"| web process database connections (peak) | {load['web_conns']} |")
    print(f"| worker database connections (peak): streaming / same runs not streaming | "
          f"{load['worker_conns']} / {quiet['worker_conns']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
