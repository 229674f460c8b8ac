"""The HTTP reward client against a real local server (127.0.0.1, ephemeral port, started by the test)."""

from __future__ import annotations

import base64
import io
import json
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
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, payload = outer.handler(body)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

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
