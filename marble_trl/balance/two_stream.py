"""The two-stream gradient engine (METHOD.md section 3; the derivation and its assumptions are in
:mod:`marble_trl.balance.engines`): :class:`TwoStreamGradientEngine`, the autograd tap it puts on every supported
``nn.Linear`` output, the forward pre-hook that makes the tap save no extra activation (:func:`_prepare_input`), and
which trainable parameters it can handle (:func:`find_unsupported_params`: the weight/bias of plain ``nn.Linear``
layers, not read by a LoRA variant such as DoRA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .gradient_buffers import _EngineBase


class _Site:
    """One supported Linear layer: where its weight/bias gradients go in the flat buffers."""

    __slots__ = ("module", "name", "weight_offset", "bias_offset")

    def __init__(self, module: nn.Linear, name: str, weight_offset: int | None, bias_offset: int | None) -> None:
        self.module = module
        self.name = name
        self.weight_offset = weight_offset
        self.bias_offset = bias_offset


class _Tap(torch.autograd.Function):
    """Identity on a Linear's output that hands ``(x, delta)`` to the engine during the engine's backward passes.

    ``x`` is stored with ``save_for_backward`` (not in Python), so it shares storage with the tensor the Linear itself
    saves, and under non-reentrant gradient checkpointing it is dropped and recomputed like any activation: the
    engine always sees the recomputed input. ``mark_dirty`` (instead of returning a view) keeps later in-place ops on
    the output legal. The ``dummy`` input is a leaf the engine differentiates against, which makes autograd run every
    tap without computing (or accumulating) any parameter gradient.
    """

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor | None, dummy: Tensor, engine: TwoStreamGradientEngine, site: _Site):
        ctx.engine, ctx.site = engine, site
        ctx.has_x = x is not None
        if x is not None:
            ctx.save_for_backward(x)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        x = ctx.saved_tensors[0] if ctx.has_x else None
        ctx.engine._on_output_grad(ctx.site, x, dy)
        return dy, None, None, None, None


class TwoStreamGradientEngine(_EngineBase):
    """Per-reward gradients from two cotangent streams and per-sample Linear weight gradients (METHOD.md section 3).

    Every parameter in ``params`` must be the weight or bias of a plain ``nn.Linear`` inside ``module`` (see
    :func:`find_unsupported_params`). ``capture`` installs forward hooks on those layers and removes them on exit.
    Memory: no activation beyond what autograd saves anyway (the tap saves the tensor the Linear saves, see
    :func:`_prepare_input`), plus, transiently per layer during the ``e`` pass, a ``[B, out, in]`` per-sample
    gradient (small for LoRA).
    """

    def __init__(self, params: list[nn.Parameter], num_rewards: int, module: nn.Module) -> None:
        super().__init__(params, num_rewards)
        unsupported = find_unsupported_params(self.params, module)
        if unsupported:
            raise ValueError(f"two_stream cannot handle trainable parameter {unsupported[0]}; use 'reference'.")
        self._sites = self._build_sites(module)
        self._module = module
        self._dummy = torch.zeros((), device=self._buffers.device, requires_grad=True)
        # The u stream is common to all K rewards: accumulate it once ([P], not [K, P]: halves the buffer traffic) and
        # fold it into the K rows when `buffers` is read (once per optimizer step in the trainer).
        self._common = torch.zeros_like(self._buffers[0])
        self._common_dirty = False
        self._mode: str | None = None  # None (pass-through), "u" or "e": the stream being back-propagated
        self._r: Tensor | None = None
        # The current pass's [K, B] per-sample coefficients (e: r, or w * r; u with weights: w), None: u aggregated
        self._coeffs: Tensor | None = None
        self._batch = 0
        self._taps_fired = 0

    @property
    def buffers(self) -> Tensor:
        """``[K, P]``: row k = the accumulated ``scale * grad sum_i l_k`` of ``params``, flat, in list order."""
        if self._common_dirty:
            self._buffers.add_(self._common)
            self._common.zero_()
            self._common_dirty = False
        return self._buffers

    def reset(self) -> None:
        """Zero the buffers in place (the allocation is kept)."""
        self._buffers.zero_()
        self._common.zero_()
        self._common_dirty = False

    def _build_sites(self, module: nn.Module) -> list[_Site]:
        sites = []
        for name, m in module.named_modules(remove_duplicate=False):
            if not _is_plain_linear(m):
                continue
            w_off = self._offsets.get(id(m.weight))
            b_off = self._offsets.get(id(m.bias)) if m.bias is not None else None
            if w_off is not None or b_off is not None:
                sites.append(_Site(m, name, w_off, b_off))
        # A module reachable under several names must be hooked once (its forward hooks would fire per handle).
        unique: dict[int, _Site] = {}
        for s in sites:
            unique.setdefault(id(s.module), s)
        return list(unique.values())

    @contextlib.contextmanager
    def capture(self, module: nn.Module) -> Iterator[None]:
        """Install the taps on the supported layers for the duration of the block (forward AND ``accumulate``)."""
        hooks = [
            (site.module, _prepare_input if site.weight_offset is not None else None, self._make_hook(site), False)
            for site in self._sites
        ]
        with tapped(self, module, hooks):
            yield

    def _make_hook(self, site: _Site):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
            # No graph (no_grad forwards such as v_old/v_ref, or a frozen layer): nothing to capture.
            if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
                return None
            x = args[0].detach() if site.weight_offset is not None else None
            return _Tap.apply(output, x, self._dummy, self, site)

        return hook

    def accumulate(
        self,
        loss_pos: Tensor,
        loss_neg: Tensor,
        r: Tensor,
        scale: float,
        extra_loss: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> None:
        """``buffers[k] += G_u + sum_i r_ki G_e,i`` from two backward passes; ``extra_loss`` goes to ``.grad``.

        With ``weights`` ``w`` [K, B] (a masked solve's per-reward sample weights) the ``u`` stream is per sample
        too: ``buffers[k] += sum_i w_ki G_u,i + sum_i w_ki r_ki G_e,i``."""
        self._check_inputs(loss_pos, loss_neg, r, weights)
        has_extra = extra_loss is not None and extra_loss.requires_grad
        self._batch = loss_pos.shape[0]
        self._r = r.detach().to(device=self._buffers.device, dtype=self._buffers.dtype)
        u_coeffs = None
        if weights is not None:
            u_coeffs = weights.detach().to(device=self._buffers.device, dtype=self._buffers.dtype)
            self._r = u_coeffs * self._r
        u = scale * loss_neg.sum()
        e = scale * (loss_pos - loss_neg).sum()
        try:
            # Differentiating wrt the dummy leaf runs every tap but computes no parameter gradient and touches no .grad.
            for mode, stream, retain in (("u", u, True), ("e", e, has_extra)):
                self._mode, self._taps_fired = mode, 0
                self._coeffs = self._r if mode == "e" else u_coeffs  # None: the u stream aggregated, common to all k
                torch.autograd.grad(stream, [self._dummy], retain_graph=retain, allow_unused=True)
                if self._taps_fired == 0:
                    raise RuntimeError(
                        "No captured layer received a gradient: run the trainable forward inside engine.capture()."
                    )
        finally:
            self._mode, self._r, self._coeffs = None, None, None
            self._common_dirty = True
        self._backward_extra(extra_loss)  # taps pass the KL cotangent through untouched (mode None)

    def _on_output_grad(self, site: _Site, x: Tensor | None, dy: Tensor) -> None:
        if self._mode is None:
            return
        self._taps_fired += 1
        b = self._batch
        if dy.ndim < 2 or dy.shape[0] != b:
            raise RuntimeError(
                f"Layer {site.name!r} sees a batch of {dy.shape[0] if dy.ndim else 0} (shape {tuple(dy.shape)}), "
                f"the loss one of {b}: the two-stream engine needs the sample index on dim 0."
            )
        buf, common = self._buffers, self._common
        with torch.no_grad():
            dy3 = dy.reshape(b, -1, dy.shape[-1])  # [B, N, out]; N = tokens (1 for [B, dim] layers)
            if site.weight_offset is not None:
                assert x is not None
                x3 = x.reshape(b, -1, x.shape[-1])  # [B, N, in]
                dtype = torch.promote_types(dy3.dtype, x3.dtype)
                off, n = site.weight_offset, dy3.shape[-1] * x3.shape[-1]
                if self._coeffs is None:
                    # Aggregated over samples and tokens: one [out, N*B] x [N*B, in] product.
                    g = dy3.reshape(-1, dy3.shape[-1]).to(dtype).T @ x3.reshape(-1, x3.shape[-1]).to(dtype)
                    common[off : off + n].add_(g.reshape(n).to(buf.dtype))
                else:
                    # Per-sample first ([B, out, in], token sum inside the bmm), then [K, B] x [B, out*in].
                    g = torch.bmm(dy3.to(dtype).transpose(1, 2), x3.to(dtype))
                    buf[:, off : off + n].addmm_(self._coeffs, g.reshape(b, n).to(buf.dtype))
            if site.bias_offset is not None:
                off, n = site.bias_offset, dy3.shape[-1]
                gb = dy3.sum(dim=1).to(buf.dtype)  # [B, out]
                if self._coeffs is None:
                    common[off : off + n].add_(gb.sum(dim=0))
                else:
                    buf[:, off : off + n].addmm_(self._coeffs, gb)


def _prepare_input(module: nn.Module, args: tuple) -> tuple | None:
    """Make the copies F.linear would make anyway before the Linear runs, so the Linear and the tap save ONE tensor.

    - autocast: F.linear casts float32 inputs to the autocast dtype and saves that copy (peft moreover up-casts LoRA
      inputs to the adapter's float32 first); the tap would otherwise keep the float32 input alive as well;
    - non-contiguous ``[B, N, in]`` inputs (SD3's ``to_out``/``to_add_out`` see slices of the joint attention output):
      matmul saves a contiguous copy, while the tap would keep the whole parent buffer alive.
    Values and graph are unchanged; checked by tests/test_engines.py::test_capture_saves_no_extra_activations.
    """
    if not torch.is_grad_enabled() or not args or not isinstance(args[0], Tensor):
        return None
    x = args[0]
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.is_floating_point() and x.dtype != torch.float64:
        x = x.to(torch.get_autocast_dtype(device_type))
    x = x.contiguous()
    return None if x is args[0] else (x, *args[1:])


def _is_plain_linear(m: nn.Module) -> bool:
    # Subclasses that override forward (quantised or fused Linears) may not compute y = x W^T + b.
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def find_unsupported_params(params: list[nn.Parameter], module: nn.Module) -> list[str]:
    """Names of the params the two-stream engine cannot handle (empty list: all supported).

    Supported: weight/bias of a plain ``nn.Linear`` inside ``module``, not read by a LoRA variant (DoRA etc.)
    outside the Linear's own forward.
    """
    names: dict[int, str] = {}
    owners: dict[int, list[nn.Module]] = {}
    for mod_name, m in module.named_modules(remove_duplicate=False):
        for p_name, p in m.named_parameters(recurse=False):
            names.setdefault(id(p), f"{mod_name}.{p_name}" if mod_name else p_name)
            owners.setdefault(id(p), []).append(m)
    variants = variant_params(module)
    bad = []
    for i, p in enumerate(params):
        name = names.get(id(p), f"params[{i}] (not found in module)")
        ms = owners.get(id(p), [])
        if not ms:
            bad.append(name)
        elif not all(_is_plain_linear(m) for m in ms):
            bad.append(f"{name} ({type(ms[0]).__name__}, not a plain nn.Linear)")
        elif id(p) in variants:
            bad.append(f"{name} (LoRA variant such as DoRA)")
    return bad


def variant_params(module: nn.Module) -> set[int]:
    """Ids of the adapter parameters a LoRA variant (DoRA etc.) also reads outside their Linear's forward."""
    found: set[int] = set()
    for m in module.modules():
        variants = getattr(m, "lora_variant", None)
        if isinstance(variants, dict) and variants:
            for adapter in variants:
                for container in ("lora_A", "lora_B"):
                    sub = getattr(m, container, {})
                    if isinstance(sub, nn.ModuleDict) and adapter in sub:
                        found.update(id(p) for p in sub[adapter].parameters())
    return found


@contextlib.contextmanager
def tapped(engine, module: nn.Module, hooks: list[tuple[nn.Module, Any, Any, bool]]) -> Iterator[None]:
    """An engine's ``capture`` region: the checks, then ``(layer, pre-hook or None, hook, with_kwargs)`` installed on
    entry and removed on exit (also on an error)."""
    if engine._capturing:
        raise RuntimeError("capture() is not re-entrant.")
    if module is not engine._module:
        raise ValueError("capture() must receive the module the engine was built with (the unwrapped model).")
    handles = []
    for layer, pre_hook, hook, with_kwargs in hooks:
        if pre_hook is not None:
            handles.append(layer.register_forward_pre_hook(pre_hook))
        handles.append(layer.register_forward_hook(hook, with_kwargs=with_kwargs))
    engine._capturing = True
    try:
        yield
    finally:
        engine._capturing = False
        for h in handles:
            h.remove()
