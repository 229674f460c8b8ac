"""A client for reward servers over HTTP (GenEval, UnifiedReward, or any model kept in its own environment).

Protocol (JSON over ``POST url``; see docs/rewards.md):

- request: ``{"prompts": [str, ...], "images": [base64 str, ...], "metadata": {column: [value, ...], ...}}`` with one
  entry per sample; images are base64-encoded PNG (lossless, the default) or JPEG files, without a ``data:`` prefix;
- response: ``{"scores": [float | null, ...]}``, one per sample, ``null`` meaning "not applicable".

Connection errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff; other HTTP errors, malformed JSON
and a wrong number of scores fail at once with an error naming the reward and the URL. Only the standard library.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch

from .images import to_pil
from .registry import register_reward

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}


class HTTPRewardError(RuntimeError):
    """The reward server could not be reached or answered something the protocol does not allow."""


def encode_images(images: torch.Tensor, image_format: str = "png", jpeg_quality: int = 95) -> list[str]:
    """``[B, 3, H, W]`` floats in ``[0, 1]`` -> base64 strings of PNG or JPEG files."""
    fmt = _FORMATS[image_format.lower()]
    out = []
    for im in to_pil(images):
        buf = io.BytesIO()
        im.save(buf, format=fmt, **({"quality": jpeg_quality} if fmt == "JPEG" else {}))
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


class _Transient(Exception):
    """A failure worth retrying (network, timeout, 5xx, 429)."""


@register_reward("http_reward", factory=True)
class HTTPReward:
    """Score images on a remote server speaking the JSON protocol above.

    Options:
        url: the endpoint (``http://host:port/path``), required.
        name: the name the reward is logged under (default ``"http_reward"``); give each server its own.
        timeout: seconds to wait for one request (default 120).
        retries: extra attempts after a transient failure (default 3).
        backoff: seconds before the first retry, doubled after each (default 1.0).
        image_format: ``"png"`` (default, lossless) or ``"jpeg"`` (smaller; quality ``jpeg_quality``, default 95).
        batch_size: samples per request (default: the whole batch in one request).
        columns: dataset columns to send as ``metadata`` (default: all that the trainer passes).
        headers: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``).
    """

    def __init__(
        self,
        url: str,
        name: str = "http_reward",
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        image_format: str = "png",
        jpeg_quality: int = 95,
        batch_size: int | None = None,
        columns: Sequence[str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not url or not str(url).startswith(("http://", "https://")):
            raise ValueError(f"Reward {name!r}: url must start with http:// or https://, got {url!r}.")
        if image_format.lower() not in _FORMATS:
            raise ValueError(f"Reward {name!r}: image_format must be 'png' or 'jpeg', got {image_format!r}.")
        if timeout <= 0 or retries < 0 or backoff < 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"Reward {name!r}: need timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1.")
        self.__name__ = name
        self.url = str(url)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.image_format = image_format.lower()
        self.jpeg_quality = int(jpeg_quality)
        self.batch_size = batch_size
        self.columns = list(columns) if columns is not None else None
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def __repr__(self) -> str:
        return f"HTTPReward(name={self.__name__!r}, url={self.url!r})"

    def _fail(self, message: str) -> HTTPRewardError:
        return HTTPRewardError(f"Reward {self.__name__!r} at {self.url}: {message}")

    def _payload(self, prompts: list[str], images: torch.Tensor, columns: dict[str, Any]) -> bytes:
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
        return json.dumps(body).encode("utf-8")

    def _post_once(self, data: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read(300).decode("utf-8", "replace").strip()
            message = f"HTTP {err.code} {err.reason}" + (f": {detail}" if detail else "")
            if err.code >= 500 or err.code == 429:
                raise _Transient(message) from err
            raise self._fail(message) from err
        except TimeoutError as err:
            raise _Transient(f"no answer within {self.timeout:g} s") from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):  # socket.timeout is an alias of TimeoutError
                raise _Transient(f"no answer within {self.timeout:g} s") from err
            raise _Transient(f"cannot connect ({err.reason})") from err
        except (OSError, http.client.HTTPException) as err:  # reset / refused / truncated mid-request
            raise _Transient(f"connection failed ({type(err).__name__}: {err})") from err

    def _post(self, data: bytes) -> bytes:
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._post_once(data)
            except _Transient as err:
                if attempt + 1 == attempts:
                    raise self._fail(f"{err} (after {attempts} attempt{'s' if attempts > 1 else ''}).") from err
                time.sleep(self.backoff * 2**attempt)
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
        scores: list[float | None] = []
        for start in range(0, n, step):
            stop = min(start + step, n)
            chunk_columns = {k: list(v)[start:stop] for k, v in columns.items()}
            data = self._payload(list(prompts[start:stop]), images[start:stop], chunk_columns)
            scores.extend(self._parse(self._post(data), stop - start))
        return scores


@register_reward("geneval", factory=True)
def geneval(url: str, name: str = "geneval", **options: Any) -> HTTPReward:
    """GenEval served over HTTP (an :class:`HTTPReward` logged as ``geneval``; the server reads ``metadata``)."""
    return HTTPReward(url, name=name, **options)


@register_reward("unifiedreward", factory=True)
def unifiedreward(url: str, name: str = "unifiedreward", **options: Any) -> HTTPReward:
    """UnifiedReward served over HTTP (an :class:`HTTPReward` logged as ``unifiedreward``)."""
    return HTTPReward(url, name=name, **options)
