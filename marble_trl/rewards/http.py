"""A client for reward servers over HTTP (GenEval, UnifiedReward, or any model kept in its own environment).

Protocol (JSON over ``POST url``; see docs/rewards.md):

- request: ``{"prompts": [str, ...], "images": [base64 str, ...], "metadata": {column: [value, ...], ...}}`` with one
  entry per sample; images are base64-encoded PNG (lossless, the default) or JPEG files, without a ``data:`` prefix;
  an editing model's rewards also send ``"source_images": [base64 str, ...]``, the image each sample edited (so a
  VLM judge grades the edit against its source);
- response: ``{"scores": [float | null, ...]}``, one per sample, ``null`` meaning "not applicable".

Time limits: ``timeout`` is a wall-clock deadline for one whole request (connect, send, the full response), which a
server trickling bytes cannot stretch; ``total_timeout`` bounds one call (a training step's scoring) across all its
requests, retries and backoff waits. Connection errors, missed deadlines, HTTP 5xx and 429 are retried with exponential
backoff while the budget lasts; other HTTP errors, malformed JSON and a wrong number of scores fail at once. Every error
names the reward, the URL, the attempts made and, for a time limit, which one was hit. Only the standard library.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch

from .base import dataset_columns
from .http_sockets import _HANDLERS, _Sockets
from .images import to_pil

logger = logging.getLogger(__name__)
_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}


class HTTPRewardError(RuntimeError):
    """The reward server could not be reached or answered something the protocol does not allow."""


def encode_images(images: torch.Tensor, image_format: str = "png", jpeg_quality: int = 95) -> list[str]:
    """``[B, 3, H, W]`` floats in ``[0, 1]`` -> base64 strings of PNG or JPEG files."""
    fmt = _FORMATS[image_format.lower()]
    out = []
    for im in to_pil(images):
        buf = io.BytesIO()
        # PNG at compression level 1: lossless like the default (6), 5x faster to encode at 512 px, ~28% larger
        im.save(buf, format=fmt, **({"quality": jpeg_quality} if fmt == "JPEG" else {"compress_level": 1}))
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


class _Transient(Exception):
    """A failure worth retrying (network, timeout, 5xx, 429)."""


class _DeadlineHit(_Transient):
    """An attempt did not finish by its deadline (``timeout``, or the end of the call's budget if that came first)."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class HTTPReward:
    """Score images on a remote server speaking the JSON protocol above.

    Options:
        url: the endpoint (``http://host:port/path``), required.
        name: the name the reward is logged under (default ``"http_reward"``); give each server its own.
        timeout: wall-clock seconds for one whole request: connect, send and the full response (default 120). A
            server that trickles its answer cannot stretch it.
        total_timeout: wall-clock seconds for one call (one training step's scoring on this process), across all its
            requests, retries and backoff waits (default: ``3 * (timeout + backoff)`` for each request the call
            makes, one unless ``batch_size`` splits the batch: three full-length attempts and the waits between
            them). An attempt running at its end is cut off; a retry that could not start before it is not made.
        retries: extra attempts after a transient failure (default 3).
        backoff: seconds before the first retry, doubled after each (default 1.0).
        image_format: ``"png"`` (default, lossless) or ``"jpeg"`` (smaller; quality ``jpeg_quality``, default 95).
        batch_size: samples per request (default: the whole batch in one request).
        columns: dataset columns to send as ``metadata`` (default: all that the trainer passes).
        headers: extra HTTP headers. Secrets here are recorded with the run's configuration (checkpoint manifests,
            ``training_args.bin``, trackers): pass a token with ``token_env`` instead.
        token_env: the name of an environment variable holding a bearer token (``marble-trl serve-reward --token``):
            sent as ``Authorization: Bearer <token>``; only the variable's name is recorded.
    """

    def __init__(
        self,
        url: str,
        name: str = "http_reward",
        timeout: float = 120.0,
        total_timeout: float | None = None,
        retries: int = 3,
        backoff: float = 1.0,
        image_format: str = "png",
        jpeg_quality: int = 95,
        batch_size: int | None = None,
        columns: Sequence[str] | None = None,
        headers: dict[str, str] | None = None,
        token_env: str | None = None,
    ) -> None:
        if not url or not str(url).startswith(("http://", "https://")):
            raise ValueError(f"Reward {name!r}: url must start with http:// or https://, got {url!r}.")
        if image_format.lower() not in _FORMATS:
            raise ValueError(f"Reward {name!r}: image_format must be 'png' or 'jpeg', got {image_format!r}.")
        if timeout <= 0 or retries < 0 or backoff < 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"Reward {name!r}: need timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1.")
        if total_timeout is not None and not total_timeout > 0:
            raise ValueError(f"Reward {name!r}: total_timeout must be > 0 seconds (or None), got {total_timeout!r}.")
        self.__name__ = name
        self.url = str(url)
        self.timeout = float(timeout)
        self.total_timeout = None if total_timeout is None else float(total_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.image_format = image_format.lower()
        self.jpeg_quality = int(jpeg_quality)
        self.batch_size = batch_size
        self.columns = list(columns) if columns is not None else None
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        if any(k.lower() == "authorization" for k in (headers or {})):
            logger.warning(
                "Reward %r: an Authorization header in reward_kwargs is recorded with the run's configuration "
                "(checkpoints, training_args.bin, trackers); pass the token through an environment variable with "
                "token_env instead.",
                name,
            )
        if token_env is not None:
            token = os.environ.get(str(token_env))
            if not token:
                raise ValueError(
                    f"Reward {name!r}: token_env={token_env!r} but the environment variable {token_env} is not set "
                    "(or empty) in this process; export it on every node before launching."
                )
            self.headers["Authorization"] = f"Bearer {token}"

    def __repr__(self) -> str:
        return f"HTTPReward(name={self.__name__!r}, url={self.url!r})"

    def _fail(self, message: str) -> HTTPRewardError:
        return HTTPRewardError(f"Reward {self.__name__!r} at {self.url}: {message}")

    def _payload(
        self, prompts: list[str], images: torch.Tensor, columns: dict[str, Any], sources: torch.Tensor | None = None
    ) -> bytes:
        metadata = {}
        for key, values in columns.items():
            if self.columns is not None and key not in self.columns:
                continue
            values = list(values)
            try:
                json.dumps(values)
            except (TypeError, ValueError) as err:
                raise self._fail(
                    f"column {key!r} is not JSON-serialisable ({err}); pass `columns` to choose which columns to send."
                ) from err
            metadata[key] = values
        body = {
            "prompts": list(prompts),
            "images": encode_images(images, self.image_format, self.jpeg_quality),
            "metadata": metadata,
        }
        if sources is not None:
            body["source_images"] = encode_images(sources, self.image_format, self.jpeg_quality)
        return json.dumps(body).encode("utf-8")

    def _request(self, data: bytes, deadline: float, sockets: _Sockets) -> bytes:
        """One attempt, run in a worker thread; the caller stops waiting and cuts ``sockets`` at ``deadline``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _DeadlineHit()
        # The ordinary urllib chain (proxies from the environment, redirects, https), with sockets tracked.
        opener = urllib.request.build_opener(*(handler(sockets) for handler in _HANDLERS))
        request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
        try:
            with opener.open(request, timeout=remaining) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read(300).decode("utf-8", "replace").strip()
            message = f"HTTP {err.code} {err.reason}" + (f": {detail}" if detail else "")
            if err.code >= 500 or err.code == 429:
                raise _Transient(message) from err
            raise self._fail(message) from err
        except TimeoutError as err:
            raise _DeadlineHit() from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):  # socket.timeout is an alias of TimeoutError
                raise _DeadlineHit() from err
            raise _Transient(f"cannot connect ({err.reason})") from err
        except (OSError, http.client.HTTPException) as err:  # reset / refused / truncated mid-request
            if time.monotonic() >= deadline:  # cut off at the deadline
                raise _DeadlineHit() from err
            raise _Transient(f"connection failed ({type(err).__name__}: {err})") from err

    def _post_once(self, data: bytes, deadline: float) -> bytes:
        """One attempt that returns or raises by ``deadline`` (``time.monotonic()``), whatever the server does.

        A socket timeout only bounds each read, so a server sending a byte now and then could hold a request open
        for ever. The request runs in a worker thread instead; at the deadline this thread stops waiting, shuts the
        connection down (which ends the worker's read) and raises :class:`_DeadlineHit`. That covers every phase:
        name lookup, connect, TLS handshake, sending, the status line, the headers and the body. (A name lookup
        still running is left to finish in the daemon worker, whose socket is then cut as soon as it opens.)
        """
        sockets = _Sockets()
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                outcome["body"] = self._request(data, deadline, sockets)
            except BaseException as err:  # handed to the caller
                outcome["error"] = err
            finally:
                done.set()

        threading.Thread(target=work, name=f"reward-{self.__name__}-http", daemon=True).start()
        try:
            done.wait(max(deadline - time.monotonic(), 0.0))
        finally:
            if not done.is_set():  # the deadline (or Ctrl-C): cut the connection so that the worker ends too
                sockets.cancel()
            else:
                sockets.close()
        if not done.is_set():
            raise _DeadlineHit()
        if "error" in outcome:
            raise outcome.pop("error")
        return outcome["body"]

    def _post(self, data: bytes, budget_end: float, budget: str, request: str) -> bytes:
        """Attempts with exponential backoff, each within ``timeout`` and all before ``budget_end``."""
        attempts = self.retries + 1
        check = f"check that the server at {self.url} is up and healthy"
        last = ""  # why the previous attempt failed
        raise_options = "`total_timeout`"
        for attempt in range(1, attempts + 1):
            start = time.monotonic()
            left = budget_end - start
            if left <= 0:  # spent by the earlier requests of this call
                raise self._fail(
                    f"the total budget {budget} ran out before attempt {attempt} of {attempts}{request} could "
                    f"start{last}; not retrying. Raise {raise_options}, or {check}."
                )
            # Cut by the budget only when it leaves clearly less than `timeout` (not when both end together).
            cut_by_budget = left < 0.99 * self.timeout
            try:
                return self._post_once(data, start + min(self.timeout, left))
            except _Transient as err:
                if isinstance(err, _DeadlineHit):
                    if cut_by_budget:
                        raise self._fail(
                            f"the total budget {budget} ran out during attempt {attempt} of {attempts}{request} (no "
                            f"answer in the {left:.3g} s left{last}); not retrying. Raise {raise_options}, or {check}."
                        ) from err
                    reason = f"no answer within {self.timeout:g} s"
                    fix = (
                        f"Hit the per-request deadline `timeout` = {self.timeout:g} s (connect, send and the whole "
                        f"response); raise `timeout` if the server is just slow, or {check}."
                    )
                    raise_options = "`total_timeout` (and `timeout`, if one request needs longer)"
                else:
                    reason = str(err)
                    fix = f"Raise `retries` or `backoff` if the server needs time to start, or {check}."
                if attempt == attempts:
                    raise self._fail(f"{reason} (after {_plural(attempts, 'attempt')}{request}). {fix}") from err
                last = f"; attempt {attempt}: {reason}"
                pause = self.backoff * 2 ** (attempt - 1)
                if time.monotonic() + pause >= budget_end:
                    raise self._fail(
                        f"the total budget {budget} ends before the next retry (in {pause:g} s) could start, "
                        f"after attempt {attempt} of {attempts}{request} failed with: {reason}; not retrying. "
                        f"Raise {raise_options}, or {check}."
                    ) from err
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _parse(self, raw: bytes, n: int) -> list[float | None]:
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise self._fail(f"the response is not JSON ({err}); it starts with {raw[:200]!r}.") from err
        if not isinstance(body, dict) or not isinstance(body.get("scores"), list):
            raise self._fail(f'the response must be a JSON object {{"scores": [...]}}, got {str(body)[:200]!r}.')
        scores = body["scores"]
        if len(scores) != n:
            raise self._fail(f"the server returned {len(scores)} scores for {n} samples.")
        out: list[float | None] = []
        for i, s in enumerate(scores):
            if s is None:
                out.append(None)
            elif isinstance(s, Real) and not isinstance(s, bool):
                out.append(None if math.isnan(float(s)) else float(s))
            else:
                raise self._fail(f"score {i} is {s!r}; scores must be numbers or null.")
        return out

    def __call__(self, prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
        n = len(prompts)
        step = self.batch_size or max(n, 1)
        n_requests = math.ceil(n / step)
        if self.total_timeout is not None:
            total, budget = self.total_timeout, f"`total_timeout` = {self.total_timeout:g} s"
        else:
            total = 3 * (self.timeout + self.backoff) * n_requests
            budget = f"`total_timeout` = {total:g} s (the default, 3 x (`timeout` + `backoff`) per request)"
        budget_end = time.monotonic() + total
        scores: list[float | None] = []
        sources = columns.pop("source_images", None)  # an editing model's sources: sent as images, not metadata
        if sources is not None and not isinstance(sources, torch.Tensor):
            raise self._fail(
                f"source_images must be a [B, 3, H, W] tensor in [0, 1] (the trainer's), got {type(sources).__name__}."
            )
        for i, start in enumerate(range(0, n, step)):
            stop = min(start + step, n)
            chunk_columns = {k: list(v)[start:stop] for k, v in dataset_columns(columns).items()}  # not trainer_state
            chunk_sources = sources[start:stop] if isinstance(sources, torch.Tensor) else None
            data = self._payload(list(prompts[start:stop]), images[start:stop], chunk_columns, chunk_sources)
            request = f", request {i + 1} of {n_requests}" if n_requests > 1 else ""
            scores.extend(self._parse(self._post(data, budget_end, budget, request), stop - start))
        return scores


# `geneval` (a GenEval server with `url`, else in-process) is marble_trl.rewards.geneval.geneval.


def unifiedreward(url: str, name: str = "unifiedreward", **options: Any) -> HTTPReward:
    """UnifiedReward served over HTTP (an :class:`HTTPReward` logged as ``unifiedreward``)."""
    return HTTPReward(url, name=name, **options)
