"""Per-reward gradient engines ("Gram engines") for MARBLE's refresh steps.

For reward ``k`` the per-sample NFT loss is ``l_{k,i} = r_{k,i} L_pos_i + (1 - r_{k,i}) L_neg_i`` (MARBLE, arXiv
2605.06507, Eq. 4). An engine accumulates, over every (micro-batch, timestep) of one optimizer step, the K flat
gradient buffers ``buffers[k] += scale * grad_theta sum_i l_{k,i}`` of the trainable parameters ``theta``, from which
the balancer builds the Gram matrix (Eqs. 5-7). KL is not part of any ``g_k`` (Eq. 8): an optional ``extra_loss`` is
back-propagated into the ordinary ``.grad`` instead.

Two engines behind one interface (:class:`GradientEngine`):

- :class:`ReferenceGradientEngine`: MARBLE's Algorithm 1, K ``torch.autograd.grad`` calls on one retained graph.
  Works for any trainable parameter; costs K backward passes.
- :class:`TwoStreamGradientEngine` (METHOD.md section 3): the backward is linear in the cotangent at the loss, and
  ``l_{k,i} = L_neg_i + r_{k,i} (L_pos_i - L_neg_i)``. Two backward passes, one for the stream
  ``u = scale * sum_i L_neg_i`` (aggregated weight gradient, common to all k) and one for
  ``e = scale * sum_i (L_pos_i - L_neg_i)`` (per-sample weight gradients ``G_i``), give every reward:
  ``buffers[k] += G_u + sum_i r_{k,i} G_{e,i}``. Cost ~ 1 forward + 2 backward passes + K tiny ``[K, B] x [B, out*in]``
  contractions, independent of K. Supports parameters that are the weight/bias of plain ``nn.Linear`` layers (which
  covers peft LoRA: ``lora_A[adapter]`` / ``lora_B[adapter]`` are ``nn.Linear``).

Assumptions of the two-stream engine (all true for diffusers' SD3 transformer with peft LoRA):

- dim 0 of every hooked layer's input/output is the sample index, and samples are independent through the network
  (no batch-norm, no cross-sample attention), so a per-sample output gradient is the gradient of that sample's loss;
- a trainable parameter is used only through the forward of the ``nn.Linear`` modules that own it (a weight shared
  by several Linear modules, or one module called several times, is fine; a weight also read functionally elsewhere,
  e.g. DoRA's norm, is not: such LoRA variants are reported unsupported);
- gradient checkpointing must be non-reentrant (diffusers' default); the reentrant variant does not support
  ``torch.autograd.grad``, which both engines use so as to never write per-reward gradients into ``.grad``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..distributed import is_dtensor, root_unit_parameters

logger = logging.getLogger(__name__)

ENGINE_NAMES = ("auto", "reference", "two_stream")


@runtime_checkable
class GradientEngine(Protocol):
    """K per-reward gradient buffers accumulated over one optimizer step.

    Usage per (micro-batch, timestep); ``accumulate`` must run inside ``capture`` (the two-stream engine's hooks must
    still be installed when gradient checkpointing recomputes the forward during the backward)::

        with engine.capture(transformer):
            v_theta = transformer(...)
            terms = nft_loss_terms(v_theta, ...)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, scale, extra_loss=beta * terms.kl.mean())

    ``buffers`` is ``[K, P]``; row ``k`` is the flat concatenation of the gradients of ``params`` in list order
    (see :func:`unflatten`).
    """

    params: list[nn.Parameter]
    num_rewards: int
    buffers: Tensor

    def capture(self, module: nn.Module) -> AbstractContextManager[None]: ...

    def accumulate(
        self,
        loss_pos: Tensor,
        loss_neg: Tensor,
        r: Tensor,
        scale: float,
        extra_loss: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> None: ...

    def reset(self) -> None: ...


def whole_shape(p: Tensor) -> torch.Size:
    """A parameter's whole shape, also when it is sharded: a DeepSpeed ZeRO-3 partition (``ds_shape``; outside a
    gather its data is empty) or an FSDP2 ``DTensor`` (whose ``shape`` is the whole one)."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def unflatten(flat: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
    """Views of a flat ``[P]`` vector (a buffer row, or a combined direction) shaped like ``params``, in order."""
    out, offset = [], 0
    for p in params:
        shape = whole_shape(p)
        out.append(flat[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return out


def _buffer_dtype(params: list[nn.Parameter]) -> torch.dtype:
    # Accumulate in at least float32 (bf16/fp16 sums over many micro-batches lose the Gram's small entries);
    # keep float64 when the model is float64 (tests compare to 1e-10).
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


class _EngineBase:
    def __init__(self, params: list[nn.Parameter], num_rewards: int) -> None:
        if num_rewards < 1:
            raise ValueError(f"num_rewards must be >= 1, got {num_rewards}.")
        if not params:
            raise ValueError("A gradient engine needs at least one trainable parameter.")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params contains the same parameter twice.")
        self.params = list(params)
        self.num_rewards = num_rewards
        self._offsets: dict[int, int] = {}
        offset = 0
        for p in self.params:
            self._offsets[id(p)] = offset
            offset += whole_shape(p).numel()  # sharded parameters: sized without gathering them
        self._buffers = torch.zeros(
            num_rewards, offset, dtype=_buffer_dtype(self.params), device=self.params[0].device
        )
        self._capturing = False

    @property
    def buffers(self) -> Tensor:
        """``[K, P]``: row k = the accumulated ``scale * grad sum_i l_k`` of ``params``, flat, in list order."""
        return self._buffers

    def reset(self) -> None:
        """Zero the buffers in place (the allocation is kept)."""
        self._buffers.zero_()

    def _check_inputs(self, loss_pos: Tensor, loss_neg: Tensor, r: Tensor, weights: Tensor | None = None) -> None:
        if not self._capturing:
            raise RuntimeError("accumulate() must be called inside `with engine.capture(module):`.")
        if loss_pos.ndim != 1 or loss_pos.shape != loss_neg.shape:
            raise ValueError(
                f"loss_pos/loss_neg must both be [B]; got {tuple(loss_pos.shape)}, {tuple(loss_neg.shape)}."
            )
        if r.shape != (self.num_rewards, loss_pos.shape[0]):
            raise ValueError(f"r must be [K={self.num_rewards}, B={loss_pos.shape[0]}], got {tuple(r.shape)}.")
        if weights is not None and weights.shape != r.shape:
            raise ValueError(f"weights must be [K, B] like r {tuple(r.shape)}, got {tuple(weights.shape)}.")

    @staticmethod
    def _backward_extra(extra_loss: Tensor | None) -> None:
        # The KL term goes to .grad exactly like loss.backward() would put it there (the trainer adds it to d_final).
        if extra_loss is not None and extra_loss.requires_grad:
            extra_loss.backward()


class ReferenceGradientEngine(_EngineBase):
    """MARBLE Algorithm 1: one ``torch.autograd.grad`` per reward on a retained graph (K backward passes)."""

    @contextlib.contextmanager
    def capture(self, module: nn.Module) -> Iterator[None]:
        """No hooks needed; only marks the region in which ``accumulate`` may run (same contract as two-stream)."""
        if self._capturing:
            raise RuntimeError("capture() is not re-entrant.")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def accumulate(
        self,
        loss_pos: Tensor,
        loss_neg: Tensor,
        r: Tensor,
        scale: float,
        extra_loss: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> None:
        """``buffers[k] += scale * grad sum_i w_ki (r_ki L_pos_i + (1 - r_ki) L_neg_i)`` (``weights`` ``w`` [K, B],
        default 1: a masked solve's per-reward sample weights); ``extra_loss`` goes to ``.grad``."""
        self._check_inputs(loss_pos, loss_neg, r, weights)
        r = r.detach().to(loss_pos.dtype)
        w = None if weights is None else weights.detach().to(loss_pos.dtype)
        last = self.num_rewards - 1
        for k in range(self.num_rewards):
            per_sample = r[k] * loss_pos + (1.0 - r[k]) * loss_neg
            loss_k = scale * (per_sample if w is None else w[k] * per_sample).sum()
            retain = k < last or (extra_loss is not None and extra_loss.requires_grad)
            grads = torch.autograd.grad(loss_k, self.params, retain_graph=retain, allow_unused=True)
            for p, g in zip(self.params, grads):
                if g is not None:
                    off = self._offsets[id(p)]
                    self._buffers[k, off : off + p.numel()].add_(g.reshape(-1).to(self._buffers.dtype))
        self._backward_extra(extra_loss)


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
        if self._capturing:
            raise RuntimeError("capture() is not re-entrant.")
        if module is not self._module:
            raise ValueError("capture() must receive the module the engine was built with (the unwrapped model).")
        handles = []
        for site in self._sites:
            if site.weight_offset is not None:
                handles.append(site.module.register_forward_pre_hook(_prepare_input))
            handles.append(site.module.register_forward_hook(self._make_hook(site)))
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            for h in handles:
                h.remove()

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
    Values and graph are unchanged; checked by tests/test_gram.py::test_capture_saves_no_extra_activations.
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
    variant_params: set[int] = set()
    for m in module.modules():
        variants = getattr(m, "lora_variant", None)
        if isinstance(variants, dict) and variants:
            for adapter in variants:
                for container in ("lora_A", "lora_B"):
                    sub = getattr(m, container, {})
                    if isinstance(sub, nn.ModuleDict) and adapter in sub:
                        variant_params.update(id(p) for p in sub[adapter].parameters())
    bad = []
    for i, p in enumerate(params):
        name = names.get(id(p), f"params[{i}] (not found in module)")
        ms = owners.get(id(p), [])
        if not ms:
            bad.append(name)
        elif not all(_is_plain_linear(m) for m in ms):
            bad.append(f"{name} ({type(ms[0]).__name__}, not a plain nn.Linear)")
        elif id(p) in variant_params:
            bad.append(f"{name} (LoRA variant such as DoRA)")
    return bad


def make_gradient_engine(
    name: str, params: list[nn.Parameter], num_rewards: int, module: nn.Module
) -> ReferenceGradientEngine | TwoStreamGradientEngine:
    """Build an engine: ``"reference"``, ``"two_stream"``, or ``"auto"`` (two-stream when every param is supported,
    else reference with a one-line warning naming the first unsupported param).

    ``module`` must be the module whose forward the trainer wraps in ``capture`` (under DDP: the unwrapped model).
    """
    params = list(params)
    root = root_unit_parameters(module, params)
    if root:
        names = {id(p): n for n, p in module.named_parameters()}
        raise ValueError(
            f"Under FSDP2, {names.get(id(params[root[0]]), 'a trainable parameter')} (+{len(root) - 1} more) is held by "
            "the root unit (the trainer makes each LoRA layer outside the wrapped blocks a unit of its own; this one "
            "was not), and the per-reward engine's backward passes leave the root's gradient without its "
            "reduce-scatter. Target other modules (lora_target_modules), or use DDP / DeepSpeed."
        )
    if name in ENGINE_NAMES and name != "two_stream" and any(is_dtensor(p) for p in params):
        unsupported = find_unsupported_params(params, module)
        if name == "reference" or unsupported:
            what = "marble_gradient_engine='reference'" if name == "reference" else f"parameter {unsupported[0]}"
            raise ValueError(
                f"FSDP2 shards the parameters, and {what} needs the reference engine, which differentiates with "
                "respect to them (FSDP2 computes with temporary gathered copies instead). Use "
                "marble_gradient_engine='two_stream' on plain Linear LoRA layers, or DDP / DeepSpeed."
            )
    if name == "reference":
        return ReferenceGradientEngine(params, num_rewards)
    if name == "two_stream":
        return TwoStreamGradientEngine(params, num_rewards, module)
    if name == "auto":
        unsupported = find_unsupported_params(params, module)
        if not unsupported:
            return TwoStreamGradientEngine(params, num_rewards, module)
        more = f" (+{len(unsupported) - 1} more)" if len(unsupported) > 1 else ""
        logger.warning(
            "Gram engine 'auto': using 'reference' (K backward passes); unsupported: %s%s", unsupported[0], more
        )
        return ReferenceGradientEngine(params, num_rewards)
    raise ValueError(f"Unknown gradient engine {name!r}; choose one of {ENGINE_NAMES}.")
