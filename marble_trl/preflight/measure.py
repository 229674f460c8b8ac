"""``marble-trl check --measure``: one real micro-batch on this machine's GPU (the weights are loaded), timed, and
the step and run time extrapolated from it. Skipped, with a note, without a GPU. Not exercised by the CPU test
suite beyond the skip (docs/check.md).

What is timed: the rollout of one micro-batch (``num_sample_steps`` solver steps) and, for each of the ``T`` training
timesteps, the two no-grad forwards (old policy, reference) and the trainable forward and backward, as the NFT step
runs them. Not timed: the VAE decode, the rewards, MARBLE's per-reward gradient passes on refresh steps, the
optimizer step and the all-reduce; the extrapolation says so.
"""

from __future__ import annotations

import time

import torch

from .memory import GIB
from .report import Report


def measure_step(script_args, args, report: Report) -> None:
    if not torch.cuda.is_available():
        report.note("measure", "--measure skipped: no GPU on this machine (torch.cuda.is_available() is False).")
        return
    try:
        lines = _measure(script_args, args)
    except Exception as err:  # a measurement must not hide the preflight's answer
        report.warning("measure", f"--measure failed: {type(err).__name__}: {err}")
        return
    report.section("Measured on this GPU (one micro-batch)", lines)


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _measure(script_args, args) -> list[str]:
    from ..commands.train import _resolve_dtype
    from ..distributed import num_train_timesteps
    from ..models import load_model
    from ..models.editing import probe_sources
    from ..policy.lora import add_policy_adapters
    from ..rollout.solvers import make_scheduler
    from ..trainer.setup import lora_config

    device = torch.device("cuda")
    dtype = _resolve_dtype(script_args.torch_dtype, args)
    adapter = load_model(script_args.model_name_or_path, torch_dtype=dtype, tiny_seed=script_args.tiny_seed)
    adapter.pipeline.to(device)
    if adapter.video and args.num_frames is not None:
        adapter.num_frames = args.num_frames
    transformer = adapter.transformer
    add_policy_adapters(transformer, lora_config(args, default_targets=tuple(adapter.default_lora_targets)))
    if args.activation_checkpointing or args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    torch.cuda.reset_peak_memory_stats()
    mb = args.per_device_train_batch_size
    prompts = ['a photo of a red apple on a table, with a sign that says "hello"'] * mb
    # an editing model edits a blank source at its conditioning size (its tokens count like a real image's)
    sources = probe_sources(adapter, mb, adapter.source_resolution) if adapter.editing else {}
    cond = adapter.encode(prompts, args.max_sequence_length, device, args.guidance_scale, **sources)
    scheduler = make_scheduler(args.sample_scheduler, adapter.pipeline.scheduler)
    generator = torch.Generator(device).manual_seed(0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with torch.no_grad(), autocast:
        x0, rollout = _timed(
            lambda: adapter.sample(
                scheduler, cond, args.num_sample_steps, args.resolution, generator, args.guidance_scale
            )
        )
    sigmas = adapter.training_grid(args.num_sample_steps, args.resolution).to(device)
    T = num_train_timesteps(len(sigmas), args.timestep_fraction)
    transformer.train()

    def timestep(sigma):
        s = sigma.expand(x0.shape[0])
        x_t = (1 - s.view(-1, *[1] * (x0.ndim - 1))) * x0 + s.view(-1, *[1] * (x0.ndim - 1)) * torch.randn_like(x0)
        with torch.no_grad(), autocast:
            adapter.predict(transformer, x_t, s, cond)  # old policy
            adapter.predict(transformer, x_t, s, cond)  # reference
        with autocast:
            v = adapter.predict(transformer, x_t, s, cond)
        v.float().pow(2).mean().backward()

    timestep(sigmas[0])  # warm-up (kernels, allocator)
    _, train = _timed(lambda: [timestep(sigmas[i]) for i in range(T)])
    peak = torch.cuda.max_memory_allocated()
    ga = args.gradient_accumulation_steps
    step = ga * (rollout + train)
    run = step * args.max_steps if args.max_steps > 0 else None
    return [
        "| quantity | value |",
        "| --- | ---: |",
        f"| rollout of one micro-batch ({mb} samples, {args.num_sample_steps} steps) | {rollout:.2f} s |",
        f"| training passes of one micro-batch ({T} timesteps x 3 forwards + 1 backward) | {train:.2f} s |",
        f"| peak memory allocated by torch (one process) | {peak / GIB:.2f} GiB |",
        f"| optimizer step ({ga} micro-batches per process) | ~{step:.0f} s + decode, rewards, refreshes |",
        f"| run ({args.max_steps} steps) | " + (f"~{run / 3600:.1f} h |" if run else "max_steps not set |"),
    ]
