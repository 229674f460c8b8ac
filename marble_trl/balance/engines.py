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

The flat buffers' layout and the engines' common base are in :mod:`.gradient_buffers`, the two-stream engine in
:mod:`.two_stream`; this module holds the interface, the reference engine and :func:`make_gradient_engine`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..distributed import is_dtensor, root_unit_parameters
from .gradient_buffers import _EngineBase
from .layer_gram import LayerGramEngine
from .two_stream import TwoStreamGradientEngine, find_unsupported_params

logger = logging.getLogger(__name__)

ENGINE_NAMES = ("auto", "reference", "two_stream", "layer_gram")


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
    (see :func:`~.gradient_buffers.unflatten`).
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


def make_gradient_engine(
    name: str,
    params: list[nn.Parameter],
    num_rewards: int,
    module: nn.Module,
    reduce: Callable[[Tensor], None] | None = None,
) -> ReferenceGradientEngine | TwoStreamGradientEngine | LayerGramEngine:
    """Build an engine: ``"reference"``, ``"two_stream"``, ``"auto"`` (two-stream when every param is supported,
    else reference with a one-line warning naming the first unsupported param), or ``"layer_gram"`` (the Gram of a
    solved pair without per-reward buffers, :mod:`.layer_gram`; ``reduce`` averages its slices over the processes).

    ``module`` must be the module whose forward the trainer wraps in ``capture`` (under DDP: the unwrapped model).
    """
    params = list(params)
    if name == "layer_gram":
        return LayerGramEngine(params, num_rewards, module, reduce=reduce)
    root = root_unit_parameters(module, params)
    if root:
        names = {id(p): n for n, p in module.named_parameters()}
        raise ValueError(
            f"Under FSDP2, {names.get(id(params[root[0]]), 'a trainable parameter')} (+{len(root) - 1} more) is held by "
            "the root unit (the trainer makes each LoRA layer outside the wrapped blocks a unit of its own; this one "
            "was not), and the per-reward engine's backward passes leave the root's gradient without its "
            "reduce-scatter. Target other modules (lora_target_modules), or use DDP / DeepSpeed."
        )
    if name in ("auto", "reference") and any(is_dtensor(p) for p in params):
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
