"""``marble-trl serve-reward``: one reward served over HTTP for ``http_reward`` clients (:mod:`marble_trl.rewards.serve`).

Serves until SIGTERM or SIGINT (then stops accepting, lets the requests in flight finish for ``--shutdown_grace``
seconds and exits 0), or until the reward fails to load (exit 1). Also ``python -m marble_trl.cli serve-reward``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from typing import Any

from ..rewards.serve import TOKEN_ENV, RewardServer, logger
from ..rewards.serve_protocol import ServeLimits


def _at_least(minimum: float, kind: type = int) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from err
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


def serve_reward_parser() -> argparse.ArgumentParser:
    d = ServeLimits()
    p = argparse.ArgumentParser(
        prog="marble-trl serve-reward",
        description="Serve one reward over HTTP for http_reward clients: POST /score, GET /health (docs/rewards.md, "
        "'Serving a reward over HTTP').",
    )
    p.add_argument("--reward", required=True, help="A registered reward name or a 'module:object' path.")
    p.add_argument("--reward_kwargs", help='The reward\'s options as a JSON object, e.g. \'{"device": "cuda"}\'.')
    p.add_argument("--name", help="The reward's name in the server's logs (default: the reward's own).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    p.add_argument("--port", type=_at_least(0), default=18085, help="Port (0: any free port, logged at start).")
    p.add_argument("--path", default="/score", help="The scoring endpoint.")
    p.add_argument("--token", help=f"Bearer token clients must send (default: ${TOKEN_ENV}, which `ps` cannot show).")
    p.add_argument("--max_request_bytes", type=_at_least(1), default=d.max_request_bytes, help="Largest body.")
    p.add_argument("--max_images", type=_at_least(1), default=d.max_images, help="Most images per request.")
    p.add_argument("--max_image_pixels", type=_at_least(1), default=d.max_image_pixels, help="Largest image, W x H.")
    p.add_argument("--max_total_pixels", type=_at_least(1), default=d.max_total_pixels, help="Most pixels a request.")
    p.add_argument(
        "--client_timeout", type=_at_least(0.001, float), default=d.client_timeout,
        help="Seconds a client has to send its whole request (and again to read the answer).",
    )  # fmt: skip
    p.add_argument(
        "--max_concurrent_requests", type=_at_least(1), default=d.max_concurrent_requests,
        help="Requests read, queued or scored at once (their bodies are in memory); more: 503.",
    )  # fmt: skip
    p.add_argument(
        "--max_connections", type=_at_least(1), default=d.max_connections, help="Open connections; more: 503."
    )
    p.add_argument(
        "--shutdown_grace", type=_at_least(0.0, float), default=30.0, help="Seconds for requests in flight."
    )
    p.add_argument("--no_warmup", action="store_true", help="Load the reward at the first request, not at start.")
    p.add_argument("--quiet", action="store_true", help="Do not log every request.")
    return p


def build_reward(spec: str, options_json: str | None) -> Any:
    """The reward ``spec`` built with the options of ``--reward_kwargs`` (a JSON object)."""
    from ..rewards import get_reward

    try:
        options = json.loads(options_json) if options_json else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"--reward_kwargs must be a JSON object of the reward's options: {err}.") from err
    if not isinstance(options, dict):
        raise ValueError(f"--reward_kwargs must be a JSON object of the reward's options, got {options_json!r}.")
    try:
        return get_reward(spec, **options)
    except TypeError as err:
        hint = ""
        if list(options) == [spec] and isinstance(options[spec], dict):
            hint = (
                f"; --reward_kwargs takes the options themselves, not keyed by the reward: {json.dumps(options[spec])}"
            )
        raise ValueError(f"Reward {spec!r} cannot be built with --reward_kwargs {options_json}: {err}{hint}.") from err


def serve_reward_command(argv: list[str]) -> int:
    a = serve_reward_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s [marble-trl serve-reward] %(levelname)s %(message)s")
    logger.setLevel(logging.INFO)
    limits = ServeLimits(
        max_request_bytes=a.max_request_bytes, max_images=a.max_images, max_image_pixels=a.max_image_pixels,
        max_total_pixels=a.max_total_pixels, client_timeout=a.client_timeout,
        max_concurrent_requests=a.max_concurrent_requests, max_connections=a.max_connections,
    )  # fmt: skip
    reward = build_reward(a.reward, a.reward_kwargs)
    token = a.token or os.environ.get(TOKEN_ENV) or None
    try:
        server = RewardServer(
            reward, name=a.name, host=a.host, port=a.port, path=a.path, token=token, limits=limits,
            warmup=not a.no_warmup, log_requests=not a.quiet,
        )  # fmt: skip
    except OSError as err:
        raise SystemExit(
            f"marble-trl serve-reward: cannot listen on {a.host}:{a.port}: {err.strerror or err}."
        ) from err
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    server.start()
    logger.info("serving reward %r on %s (GET /health; %s)", server.name, server.url, "token" if token else "no token")
    try:
        while not stop.wait(0.2) and server.warmup_error is None:
            pass
    finally:
        for sig, handler in previous.items():  # a second Ctrl-C interrupts the grace period
            signal.signal(sig, handler)
        logger.info("shutting down: port closed; waiting up to %g s for the requests in flight", a.shutdown_grace)
        finished = server.stop(a.shutdown_grace)
        logger.info("stopped" if finished else "stopped with requests still in flight")
    return 1 if server.warmup_error else 0
