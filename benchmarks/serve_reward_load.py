"""Requests/s and latency of ``marble-trl serve-reward`` on 127.0.0.1, side by side with the reward called in process.

    python benchmarks/serve_reward_load.py [--reward brightness] [--reward_kwargs JSON] [--batch_size 8]
        [--resolution 256] [--requests 200] [--concurrency 1 4] [--image_format png] [--server process|thread]

The server runs as its own process (``--server process``, the default: ``python -m marble_trl.cli serve-reward``
with a bearer token, as in a run) or in threads of this one (``thread``: no start-up cost, but it shares the GIL
with the clients). Each HTTP row sends ``--requests`` batches through the real client (``http_reward``: the PNG/JPEG
encoding, the request, the server's checks and decoding, the reward under its lock) from ``concurrency`` threads.
The in-process row times the reward itself on the same batch, and ``client encode`` the client's image encoding
alone. ``x in-process`` is the median latency over the in-process median; ``req/s ratio`` is the HTTP rate over the
in-process rate (1 / its median). Numbers are for this machine only; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marble_trl.rewards import get_reward  # noqa: E402
from marble_trl.rewards.http import HTTPReward, encode_images  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def start_process_server(args: argparse.Namespace, token: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "marble_trl.cli", "serve-reward", "--reward", args.reward, "--port", "0", "--quiet"]
    cmd += ["--max_images", str(max(256, args.batch_size))]
    if args.reward_kwargs:
        cmd += ["--reward_kwargs", args.reward_kwargs]
    env = {**os.environ, "MARBLE_REWARD_TOKEN": token}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if "serving reward" in line:
            url = next(word for word in line.split() if word.startswith("http://"))
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
            return proc, url
    raise SystemExit(f"the server did not start (exit code {proc.wait()})")


def load(client: HTTPReward, prompts: list[str], images: torch.Tensor, requests: int, concurrency: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                if next(counter, None) is None:
                    return
            start = time.perf_counter()
            client(prompts, images)
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - start, "latencies": latencies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward", default="brightness")
    p.add_argument("--reward_kwargs", help="The reward's options as a JSON object (as serve-reward takes them).")
    p.add_argument("--batch_size", type=int, default=8, help="Images per request.")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--requests", type=int, default=200, help="Requests per concurrency level.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--image_format", choices=["png", "jpeg"], default="png")
    p.add_argument("--server", choices=["process", "thread"], default="process")
    p.add_argument(
        "--content", choices=["smooth", "noise"], default="smooth",
        help="smooth: upsampled 16x16 noise, which compresses about like generated images; noise: PNG's worst case.",
    )  # fmt: skip
    a = p.parse_args()
    reward = get_reward(a.reward, **(json.loads(a.reward_kwargs) if a.reward_kwargs else {}))
    g = torch.Generator().manual_seed(0)
    size = 16 if a.content == "smooth" else a.resolution
    images = torch.rand(a.batch_size, 3, size, size, generator=g)
    images = torch.nn.functional.interpolate(images, size=(a.resolution, a.resolution), mode="bilinear")
    images = (images * 255).round() / 255  # what a PNG carries exactly
    prompts = [f"a photo of object {i}" for i in range(a.batch_size)]
    if callable(getattr(reward, "load", None)):
        reward.load()
    reward(prompts, images)  # warm-up
    n_local = max(5, min(a.requests, 50))
    local = timed(lambda: reward(prompts, images), n_local)
    encode = timed(lambda: encode_images(images, a.image_format), max(5, min(a.requests, 20)))

    token = secrets.token_urlsafe(24)
    if a.server == "process":
        proc, url = start_process_server(a, token)
        server = None
    else:
        from marble_trl.rewards.serve import RewardServer
        from marble_trl.rewards.serve_protocol import ServeLimits

        server = RewardServer(reward, token=token, limits=ServeLimits(max_images=max(256, a.batch_size))).start()
        proc, url = None, server.url
    try:
        client = HTTPReward(
            url, image_format=a.image_format, retries=20, backoff=0.5, headers={"Authorization": f"Bearer {token}"}
        )
        client(prompts, images)  # waits for the warm-up (503s are retried) and warms the server's reward up
        client.retries = 0
        runs = {c: load(client, prompts, images, a.requests, c) for c in a.concurrency}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if server is not None:
            server.stop()

    base = statistics.median(local)
    shape = f"batch {a.batch_size} x {a.resolution}x{a.resolution} ({a.content}), {a.image_format}"
    print(f"\nreward {a.reward!r}, {shape}, server: {a.server}, {torch.get_num_threads()} torch threads\n")
    head = [
        "mode",
        "clients",
        "calls",
        "req/s",
        "images/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "x in-process",
        "req/s ratio",
    ]
    rows = [["in-process", "1", str(n_local), f"{1 / base:.1f}", f"{a.batch_size / base:.0f}"]]
    rows[0] += [f"{percentile(local, q) * 1e3:.2f}" for q in (50, 90, 99)] + ["1.00", "1.00"]
    rows.append(["client encode", "1", str(len(encode)), f"{1 / statistics.median(encode):.1f}", ""])
    rows[-1] += [f"{percentile(encode, q) * 1e3:.2f}" for q in (50, 90, 99)] + ["", ""]
    for c, run in runs.items():
        lat, rate = run["latencies"], len(run["latencies"]) / run["wall"]
        rows.append(["http", str(c), str(len(lat)), f"{rate:.1f}", f"{rate * a.batch_size:.0f}"])
        rows[-1] += [f"{percentile(lat, q) * 1e3:.2f}" for q in (50, 90, 99)]
        rows[-1] += [f"{statistics.median(lat) / base:.2f}", f"{rate * base:.2f}"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
