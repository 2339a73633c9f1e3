"""Ctrl-C stops `relayrl status` at once, wherever it lands: inside a poll (a health check the service holds until
the signal has been sent, so the test needs no timing luck) or in the wait between refreshes."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HeldHealth(health_pb2_grpc.HealthServicer):
    """Answers SERVING, except that the `hold_from`-th Check (and every one after) waits until `release` is set."""

    def __init__(self, hold_from: int):
        self.hold_from, self.calls = hold_from, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def Check(self, request, context):
        self.calls += 1
        if self.calls >= self.hold_from:
            self.entered.set()
            self.release.wait(60)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def held_service():
    servers = []

    def start(hold_from: int) -> tuple[str, HeldHealth]:
        health = HeldHealth(hold_from)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, health))
        return f"127.0.0.1:{port}", health

    yield start
    for server, health in servers:
        health.release.set()
        server.stop(0)


def _watch(address: str, *flags: str) -> subprocess.Popen:
    # --timeout 60: a poll the service holds would otherwise end by its own deadline, not by the signal.
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "status", address, "--watch", "--timeout", "60",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})


def _stopped_within(watch: subprocess.Popen, seconds: float) -> float:
    sent = time.monotonic()
    watch.send_signal(signal.SIGINT)
    try:
        watch.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        watch.kill()
        out, err = watch.communicate()
        pytest.fail(f"relayrl status --watch still running {seconds} s after Ctrl-C: {out[-2000:]} {err[-2000:]}")
    return time.monotonic() - sent


@pytest.mark.parametrize("hold_from", [1, 3], ids=["first poll", "a later poll"])
def test_ctrl_c_inside_a_poll_stops_the_watch_at_once(held_service, hold_from):
    address, health = held_service(hold_from)
    watch = _watch(address, "--interval", "0.2")
    assert health.entered.wait(60), "the watch never polled the service"
    took = _stopped_within(watch, 5)
    assert watch.returncode == 0, watch.stderr.read() if watch.stderr else ""
    assert took < 5


def test_ctrl_c_in_the_wait_between_refreshes_stops_the_watch_at_once(held_service):
    address, health = held_service(hold_from=10**6)
    watch = _watch(address, "--interval", "30", "--json")
    deadline = time.monotonic() + 60
    while health.calls < 1 and time.monotonic() < deadline:  # the first poll is done: the watch now waits 30 s
        time.sleep(0.05)
    time.sleep(0.5)
    _stopped_within(watch, 5)
    assert watch.returncode == 0
