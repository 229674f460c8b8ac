"""The HTTP reward client against a real local server (127.0.0.1, ephemeral port, started by the test)."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from PIL import Image

from marble_trl.rewards import RewardError, get_reward, resolve_reward_funcs, score_rewards
from marble_trl.rewards.http import HTTPReward, HTTPRewardError

# handler(body) -> (status, response bytes); it may sleep to simulate a slow server.
Handler = Callable[[dict[str, Any]], tuple[int, bytes]]


class RewardServer:
    """A tiny reward server; ``handler`` decides each answer and ``requests`` records what was received."""

    def __init__(self) -> None:
        self.handler: Handler = self.brightness
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []  # time.monotonic() at which each request was read
        # Trickle mode: send the answer one byte every `trickle` seconds (only the body, or with `trickle_headers`
        # the status line and headers too), for at most `trickle_for` seconds, then hang up.
        self.trickle: float | None = None
        self.trickle_headers = False
        self.trickle_for = 4.0
        self.stopped = threading.Event()  # set by close(): trickling and slow handlers stop at once
        self.client_gone = threading.Event()  # set when a write finds that the client hung up
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.arrivals.append(time.monotonic())
                outer.requests.append(body)
                status, payload = outer.handler(body)
                try:
                    if outer.trickle is not None:
                        self.send_trickle(status, payload, outer.trickle)
                        return
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    outer.client_gone.set()

            def send_trickle(self, status: int, payload: bytes, interval: float) -> None:
                head = (
                    f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                ).encode()
                if not outer.trickle_headers:
                    self.wfile.write(head)
                    self.wfile.flush()
                    head = b""
                end = time.monotonic() + outer.trickle_for
                for i in range(len(head + payload)):
                    if outer.stopped.wait(interval) or time.monotonic() > end:
                        break  # bounded: hang up mid-answer
                    self.wfile.write((head + payload)[i : i + 1])
                    self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    @staticmethod
    def decode(body: dict[str, Any]) -> list[Image.Image]:
        return [Image.open(io.BytesIO(base64.b64decode(s))) for s in body["images"]]

    def brightness(self, body: dict[str, Any]) -> tuple[int, bytes]:
        """Mean pixel value in [0, 1] per image, None for prompts starting with 'skip'."""
        scores = []
        for prompt, image in zip(body["prompts"], self.decode(body)):
            arr = torch.tensor(list(image.convert("L").getdata()), dtype=torch.float32)
            scores.append(None if prompt.startswith("skip") else arr.mean().item() / 255.0)
        return 200, json.dumps({"scores": scores}).encode()

    def close(self) -> None:
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[RewardServer]:
    srv = RewardServer()
    yield srv
    srv.close()


def grey(values: list[float], size: int = 8) -> torch.Tensor:
    return torch.stack([torch.full((3, size, size), v) for v in values])


def test_success_round_trip_with_metadata(server: RewardServer) -> None:
    fn = get_reward("http_reward", url=server.url, name="remote_brightness", retries=0)
    assert fn.__name__ == "remote_brightness"
    images = grey([0.0, 0.5, 1.0])
    out = score_rewards([fn], ["a", "b", "c"], images, columns={"tag": ["x", "y", "z"], "n": [1, 2, 3]})
    assert out[0].tolist() == pytest.approx([0.0, 128 / 255, 1.0], abs=1e-6)
    body = server.requests[-1]
    assert set(body) == {"prompts", "images", "metadata"}
    assert body["prompts"] == ["a", "b", "c"] and body["metadata"] == {"tag": ["x", "y", "z"], "n": [1, 2, 3]}
    assert [im.format for im in server.decode(body)] == ["PNG"] * 3  # lossless by default
    assert server.decode(body)[0].size == (8, 8)


def test_jpeg_batches_and_column_selection(server: RewardServer) -> None:
    fn = HTTPReward(server.url, image_format="jpeg", batch_size=2, columns=["tag"], retries=0)
    scores = fn(["a", "b", "c"], grey([0.2, 0.4, 0.6]), tag=["x", "y", "z"], other=[object()] * 3)
    assert scores == pytest.approx([0.2, 0.4, 0.6], abs=0.01)
    assert [len(r["prompts"]) for r in server.requests] == [2, 1]
    assert [r["metadata"] for r in server.requests] == [{"tag": ["x", "y"]}, {"tag": ["z"]}]
    assert {im.format for r in server.requests for im in server.decode(r)} == {"JPEG"}


def test_none_passthrough(server: RewardServer) -> None:
    fn = HTTPReward(server.url, retries=0)
    assert fn(["skip me", "score me"], grey([1.0, 1.0])) == [None, 1.0]
    server.handler = lambda body: (200, b'{"scores": [NaN, 0.5]}')
    assert fn(["a", "b"], grey([1.0, 1.0])) == [None, 0.5]


def test_timeout_is_reported_with_url_and_name(server: RewardServer) -> None:
    def slow(body: dict[str, Any]) -> tuple[int, bytes]:
        time.sleep(1.0)
        return 200, b'{"scores": [1.0]}'

    server.handler = slow
    fn = HTTPReward(server.url, name="slowpoke", timeout=0.2, retries=1, backoff=0.01)
    start = time.monotonic()
    with pytest.raises(
        HTTPRewardError, match=rf"'slowpoke' at {server.url}: no answer within 0.2 s \(after 2 attempts"
    ):
        fn(["a"], grey([0.5]))
    assert time.monotonic() - start < 1.5
    assert len(server.requests) == 2


def padded(scores: list[float], size: int) -> bytes:
    """A valid answer padded with spaces to ``size`` bytes (JSON allows trailing whitespace)."""
    return json.dumps({"scores": scores}).encode().ljust(size)


@pytest.mark.parametrize("trickle_headers", [False, True], ids=["body", "status-and-headers"])
def test_trickling_server_hits_the_request_deadline(server: RewardServer, trickle_headers: bool) -> None:
    # 1 byte every 0.25 s: every read gets data well within `timeout`, so a per-read timeout never fires and the
    # whole answer (200 bytes + headers) would take 50 s or more. The deadline covers the whole request.
    server.handler = lambda body: (200, padded([1.0], 200))
    server.trickle, server.trickle_headers = 0.25, trickle_headers
    fn = HTTPReward(server.url, name="trickle", timeout=1, retries=0)
    start = time.monotonic()
    with pytest.raises(HTTPRewardError) as info:
        fn(["a"], grey([0.5]))
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 3.0, elapsed
    message = str(info.value)
    assert message.startswith(f"Reward 'trickle' at {server.url}: no answer within 1 s (after 1 attempt")
    assert "per-request deadline `timeout` = 1 s" in message and "raise `timeout`" in message
    assert server.client_gone.wait(2.0)  # the connection was cut at the deadline, not left trickling


def test_slow_first_attempt_succeeds_on_retry_after_backoff(server: RewardServer) -> None:
    def slow_once(body: dict[str, Any]) -> tuple[int, bytes]:
        if len(server.requests) == 1:
            server.stopped.wait(3.0)  # far past the deadline
        return 200, b'{"scores": [0.25]}'

    server.handler = slow_once
    fn = HTTPReward(server.url, timeout=0.5, retries=2, backoff=0.3)
    start = time.monotonic()
    assert fn(["a"], grey([0.5])) == [0.25]
    elapsed = time.monotonic() - start
    assert len(server.requests) == 2
    gap = server.arrivals[1] - server.arrivals[0]
    assert 0.5 + 0.3 - 0.05 < gap < 0.5 + 0.3 + 1.0, gap  # the deadline, then the backoff
    assert elapsed < 2.5, elapsed


def test_backoff_doubles_between_retries(server: RewardServer) -> None:
    answers = iter([(503, b"warming up")] * 3 + [(200, b'{"scores": [0.5]}')])
    server.handler = lambda body: next(answers)
    assert HTTPReward(server.url, retries=3, backoff=0.1)(["a"], grey([0.5])) == [0.5]
    gaps = [b - a for a, b in zip(server.arrivals, server.arrivals[1:])]
    assert len(gaps) == 3
    for gap, pause in zip(gaps, [0.1, 0.2, 0.4]):
        assert pause - 0.05 < gap < pause + 0.5, gaps


def test_total_budget_stops_retries_early(server: RewardServer) -> None:
    def slow(body: dict[str, Any]) -> tuple[int, bytes]:
        server.stopped.wait(5.0)
        return 200, b'{"scores": [1.0]}'

    server.handler = slow
    # Attempts at 0-0.5 s and 0.55-1.05 s time out; the third (from 1.15 s) is cut by the budget at 1.4 s, and the
    # eight retries left are not made.
    fn = HTTPReward(server.url, name="slowpoke", timeout=0.5, retries=10, backoff=0.05, total_timeout=1.4)
    start = time.monotonic()
    with pytest.raises(HTTPRewardError) as info:
        fn(["a"], grey([0.5]))
    elapsed = time.monotonic() - start
    assert 1.3 < elapsed < 2.5, elapsed
    message = str(info.value)
    assert message.startswith(f"Reward 'slowpoke' at {server.url}: the total budget `total_timeout` = 1.4 s ")
    assert re.search(
        r"ran out during attempt 3 of 11 \(no answer in the 0\.\d+ s left; attempt 2: no answer within 0.5 s\)",
        message,
    )
    assert "not retrying" in message
    assert "Raise `total_timeout`" in message
    assert len(server.requests) == 3


def test_total_budget_skips_a_retry_that_cannot_start_in_time(server: RewardServer) -> None:
    server.handler = lambda body: (503, b"warming up")
    fn = HTTPReward(server.url, retries=5, backoff=1.0, total_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(HTTPRewardError) as info:
        fn(["a"], grey([0.5]))
    assert time.monotonic() - start < 0.5  # no pointless 1 s wait
    message = str(info.value)
    assert "the total budget `total_timeout` = 0.5 s" in message and "after attempt 1 of 6" in message
    assert "the next retry (in 1 s)" in message and "HTTP 503 Service Unavailable: warming up" in message
    assert len(server.requests) == 1


def test_total_budget_covers_the_whole_call(server: RewardServer) -> None:
    def slowish(body: dict[str, Any]) -> tuple[int, bytes]:
        server.stopped.wait(0.4)
        return server.brightness(body)

    server.handler = slowish
    fn = HTTPReward(server.url, batch_size=1, timeout=1, retries=0, total_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(
        HTTPRewardError, match=r"`total_timeout` = 1 s .*during attempt 1 of 1, request 3 of 3 \(no answer"
    ):
        fn(["a", "b", "c"], grey([0.1, 0.2, 0.3]))
    assert time.monotonic() - start < 2.0
    assert len(server.requests) == 3


def test_default_budget_is_three_full_attempts_per_request(server: RewardServer) -> None:
    def slow(body: dict[str, Any]) -> tuple[int, bytes]:
        server.stopped.wait(5.0)
        return 200, b'{"scores": [1.0]}'

    server.handler = slow
    # Budget 3 x (0.6 + 0.1) = 2.1 s: attempts at 0-0.6, 0.7-1.3 and 1.5-2.1 s each run their full `timeout`, and the
    # fourth (after a 0.4 s wait) could not start in time. On a loaded machine the third attempt may start a few ms
    # late and be cut by the budget instead: both messages name the budget, and there are 3 requests either way.
    fn = HTTPReward(server.url, timeout=0.6, retries=5, backoff=0.1)
    assert fn.total_timeout is None
    start = time.monotonic()
    with pytest.raises(HTTPRewardError) as info:
        fn(["a"], grey([0.5]))
    elapsed = time.monotonic() - start
    assert 1.7 < elapsed < 3.2, elapsed
    message = str(info.value)
    assert "`total_timeout` = 2.1 s (the default, 3 x (`timeout` + `backoff`) per request)" in message
    assert (
        "the next retry (in 0.4 s)" in message
        and "after attempt 3 of 6 failed with: no answer within 0.6 s" in message
    ) or "ran out during attempt 3 of 6" in message, message
    assert "Raise `total_timeout` (and `timeout`, if one request needs longer)" in message
    assert len(server.requests) == 3


def test_500_then_success_within_retries(server: RewardServer) -> None:
    answers = iter([(500, b"model not ready"), (503, b""), (200, b'{"scores": [0.75]}')])
    server.handler = lambda body: next(answers)
    fn = HTTPReward(server.url, retries=2, backoff=0.01)
    assert fn(["a"], grey([0.5])) == [0.75]
    assert len(server.requests) == 3


def test_permanent_500_is_a_clear_error(server: RewardServer) -> None:
    server.handler = lambda body: (500, b"CUDA out of memory")
    fn = get_reward("geneval", url=server.url, retries=2, backoff=0.01)
    assert fn.__name__ == "geneval"
    with pytest.raises(RewardError, match=r"'geneval'.*HTTP 500.*CUDA out of memory.*after 3 attempts"):
        score_rewards([fn], ["a"], grey([0.5]))
    assert len(server.requests) == 3


def test_client_errors_are_not_retried(server: RewardServer) -> None:
    server.handler = lambda body: (404, b"no such endpoint")
    with pytest.raises(HTTPRewardError, match=r"HTTP 404.*no such endpoint"):
        HTTPReward(server.url, retries=3, backoff=0.01)(["a"], grey([0.5]))
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"<html>oops</html>", "not JSON"),
        (b'{"score": [1.0]}', r'\{"scores": \[...\]\}'),
        (b'{"scores": [1.0, 2.0]}', "returned 2 scores for 1 samples"),
        (b'{"scores": ["high"]}', "must be numbers or null"),
    ],
)
def test_protocol_violations(server: RewardServer, payload: bytes, message: str) -> None:
    server.handler = lambda body: (200, payload)
    with pytest.raises(HTTPRewardError, match=rf"'unifiedreward' at {server.url}: .*{message}"):
        get_reward("unifiedreward", url=server.url, retries=3)(["a"], grey([0.5]))
    assert len(server.requests) == 1  # a malformed answer is not retried


def test_unreachable_server() -> None:
    srv = RewardServer()
    url = srv.url
    srv.close()  # nothing listens on the port any more
    with pytest.raises(HTTPRewardError, match=r"cannot connect|connection failed"):
        HTTPReward(url, retries=1, backoff=0.01)(["a"], grey([0.5]))


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="url"):
        HTTPReward("localhost:8000")
    with pytest.raises(ValueError, match="image_format"):
        HTTPReward("http://127.0.0.1:1", image_format="webp")
    with pytest.raises(ValueError, match="timeout"):
        HTTPReward("http://127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="total_timeout"):
        HTTPReward("http://127.0.0.1:1", total_timeout=0)
    with pytest.raises(HTTPRewardError, match="column 'obj' is not JSON-serialisable"):
        HTTPReward("http://127.0.0.1:1")(["a"], grey([0.5]), obj=[object()])


def test_two_servers_side_by_side(server: RewardServer) -> None:
    funcs = resolve_reward_funcs(
        ["geneval", "unifiedreward"],
        reward_kwargs={"geneval": {"url": server.url}, "unifiedreward": {"url": server.url, "image_format": "jpeg"}},
    )
    out = score_rewards(funcs, ["a", "skip"], grey([1.0, 0.0]))
    assert [f.__name__ for f in funcs] == ["geneval", "unifiedreward"]
    assert out[0, 0].item() == 1.0 and torch.isnan(out[:, 1]).all()
