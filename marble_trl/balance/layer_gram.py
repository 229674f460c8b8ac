"""The per-reward Gram of one solved pair, layer by layer, without per-reward gradient buffers
(``marble_gradient_engine="layer_gram"``; beyond the paper and the release).

The released MARBLE solves each (micro-batch, timestep) pair on its own (:mod:`marble_trl.trainer.pairwise`): the QP
needs only the K x K Gram ``M_kl = <g_k, g_l>`` of the pair's K per-reward gradients, never the gradients themselves
(:meth:`~marble_trl.balance.ReleasedMarble.solve_gram`), and the update is one ordinary weighted backward (Prop. 1).
The Gram is a sum over the trained parameters' coordinates, so it can be accumulated one slice of a layer at a time
and the slice dropped: ``M += R R^T`` with ``R`` the K rows of the slice. The other engines hold ``[K, P]`` buffers
(K + 1 copies of the trained weights with the EMA of the paper's procedure: 50 GiB for a full fine-tune of SD3.5
Medium at K = 5); this one holds ``M`` and one slice of at most ``slice_elements`` numbers, whatever K is.

How a slice's K rows are formed in one backward pass: reward ``k``'s per-sample loss is
``w_ki (r_ki L_pos_i + (1 - r_ki) L_neg_i)`` (MARBLE Eq. 4, masked), so its gradient needs each sample's ``L_pos`` and
``L_neg`` gradients apart. The policy's forward runs on the micro-batch twice, ``[batch; batch]``; ``L_pos`` is read
from the first copy and ``L_neg`` from the second, and one backward of ``sum L_pos + sum L_neg`` gives, at every
layer, the 2B per-sample gradients ``G_j``, whose rows are ``R_k = sum_j C_kj G_j`` with ``C = scale [w r, w (1 - r)]``.
Under several processes each slice's rows are averaged across them before ``R R^T`` (the Gram of the all-reduced
gradients, as the release solves it), so every process calls ``reduce`` on the same slices in the same order.

Sites (what a trained parameter must belong to):

- a plain ``nn.Linear`` (weight, bias): per-sample gradients from the layer's input and output gradient, sliced by
  output rows, as the two-stream engine forms them (:mod:`.two_stream`: same tap, same assumptions);
- any other module without submodules that is called with one tensor (a convolution, a norm, an embedding): its
  per-sample gradients by ``torch.func`` (``vmap`` of a ``vjp`` of the module's forward at the saved input), in the
  parameters' dtype, outside autocast, formed whole (``[2B, module size]``: small for convolutions and norms) before
  they are sliced.

A trained module called twice in one forward, or a weight tied between modules, is refused: the Gram is quadratic,
so each weight's gradient must be summed over its uses before the product. The ``torch.func`` modules read their
weights in the backward: FSDP2 has gathered them there; a ZeRO-3 partition not yet gathered is gathered for the tap.

Cost of a solved pair: a forward and a backward on twice the micro-batch (the two-stream engine: one forward and two
backwards on it), so twice the activations of that forward. Exact against explicit ``torch.autograd.grad``:
tests/test_layer_gram.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ..distributed import gathered, is_dtensor, not_gathered, wait_in_flight
from .diagnostics import ieee_fp32_matmul
from .gradient_buffers import _buffer_dtype
from .two_stream import _is_plain_linear, _prepare_input, _Tap, tapped, variant_params

# The bound on one slice's K rows plus its per-sample gradients: 16.8 M numbers (64 MiB in float32).
SLICE_ELEMENTS = 1 << 24


class _Site:
    __slots__ = ("module", "name", "kind", "weight", "bias", "names")

    def __init__(self, module: nn.Module, name: str, kind: str, params: list[tuple[str, nn.Parameter]]) -> None:
        self.module, self.name, self.kind = module, name, kind
        trained = dict(params)
        self.weight = "weight" in trained  # Linear sites
        self.bias = "bias" in trained
        self.names = [n for n, _ in params]  # generic sites: the trained parameters' attribute names


class LayerGramEngine:
    """The K x K per-reward Gram of one solved pair, accumulated slice by slice (see the module docstring).

    Usage per solved pair (the forward on the micro-batch twice; ``loss_pos`` / ``loss_neg`` are its [2B] terms)::

        engine.reset()
        with engine.capture(transformer):
            v = predict(transformer, *doubled_inputs)
            terms = nft_loss_terms(v, ...)
            engine.accumulate(terms.loss_pos, terms.loss_neg, r, scale, weights=w)
        gram = engine.gram  # [K, K] float64, averaged over the processes by ``reduce``

    Args:
        params: the trained parameters (each a Linear's weight/bias, or a parameter of a leaf module).
        num_rewards: K.
        module: the module whose forward ``capture`` wraps (under DDP: the unwrapped model).
        reduce: averages a tensor over the processes in place (None: one process).
        slice_elements: the bound on one slice's K rows plus its 2B per-sample gradients, in numbers.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        num_rewards: int,
        module: nn.Module,
        reduce: Callable[[Tensor], None] | None = None,
        slice_elements: int = SLICE_ELEMENTS,
    ) -> None:
        if num_rewards < 1:
            raise ValueError(f"num_rewards must be >= 1, got {num_rewards}.")
        self.params = list(params)
        if not self.params:
            raise ValueError("A gradient engine needs at least one trainable parameter.")
        self.num_rewards = num_rewards
        self._module = module
        self._reduce = reduce
        self._slice = int(slice_elements)
        self._sites, unsupported = _build_sites(self.params, module)
        if unsupported:
            more = f" (+{len(unsupported) - 1} more)" if len(unsupported) > 1 else ""
            raise ValueError(
                f"marble_gradient_engine='layer_gram' cannot handle trainable parameter {unsupported[0]}{more}: it "
                "takes the weights of nn.Linear layers and of modules without submodules called with one tensor. "
                "Leave it out of full_finetune_modules / lora_target_modules, or use another marble_gradient_engine."
            )
        self._dtype = _buffer_dtype(self.params)
        device = self.params[0].device
        self.gram = torch.zeros(num_rewards, num_rewards, dtype=torch.float64, device=device)
        self._dummy = torch.zeros((), device=device, requires_grad=True)
        self._coeffs: Tensor | None = None  # [K, 2B] during the engine's backward, else None (pass-through)
        self._fired = 0
        self._capturing = False
        self._recomputing = False
        self._calls: dict[int, int] = {}  # per site: its calls in the captured forward

    def reset(self) -> None:
        """Zero the Gram (a new pair)."""
        self.gram.zero_()

    @contextlib.contextmanager
    def capture(self, module: nn.Module) -> Iterator[None]:
        """Tap every site's output for the duration of the block (the forward and ``accumulate``)."""
        prepare = lambda site: _prepare_input if site.kind == "linear" and site.weight else None  # noqa: E731
        with tapped(self, module, [(site.module, prepare(site), self._hook(site), True) for site in self._sites]):
            self._calls = {}
            yield

    def _hook(self, site: _Site):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Tensor | None:
            if self._recomputing or not torch.is_grad_enabled():  # _generic's own forward of the module
                return None
            if not isinstance(output, Tensor):
                raise RuntimeError(
                    f"marble_gradient_engine='layer_gram': {site.name} ({type(module).__name__}) returns "
                    f"{type(output).__name__}, not a tensor; leave it out of the trained modules, or use another engine."
                )
            if not output.requires_grad:
                return None
            if self._coeffs is None:  # the forward (a checkpointed recompute in the engine's backward is not a call)
                calls = self._calls[id(site)] = self._calls.get(id(site), 0) + 1
                if calls > 1:
                    raise RuntimeError(
                        f"marble_gradient_engine='layer_gram': {site.name} ran twice in one forward; the Gram needs "
                        "each weight's gradient summed over its calls before the product. Leave it out of the "
                        "trained modules, or use another marble_gradient_engine."
                    )
            if site.kind == "generic" and (len(args) != 1 or kwargs or not isinstance(args[0], Tensor)):
                raise RuntimeError(
                    f"marble_gradient_engine='layer_gram': {site.name} ({type(module).__name__}) was called with "
                    f"{len(args)} positional and {len(kwargs)} keyword arguments; it can take modules called with "
                    "one tensor. Leave it out of the trained modules, or use another marble_gradient_engine."
                )
            x = args[0].detach() if (site.kind == "generic" or site.weight) else None
            return _Tap.apply(output, x, self._dummy, self, site)

        return hook

    def accumulate(
        self, loss_pos: Tensor, loss_neg: Tensor, r: Tensor, scale: float, weights: Tensor | None = None
    ) -> None:
        """``gram += <g_k, g_l>`` of the pair, ``g_k = scale * grad sum_i w_ki (r_ki L_pos_i + (1 - r_ki) L_neg_i)``.

        ``loss_pos`` / ``loss_neg``: [2B], the terms of the forward on ``[batch; batch]`` (``L_pos`` is read from
        the first B, ``L_neg`` from the last B); ``r`` and ``weights`` (default 1): [K, B]."""
        if not self._capturing:
            raise RuntimeError("accumulate() must be called inside `with engine.capture(module):`.")
        b = r.shape[-1]
        if r.shape != (self.num_rewards, b):
            raise ValueError(f"r must be [K={self.num_rewards}, B], got {tuple(r.shape)}.")
        if loss_pos.shape != (2 * b,) or loss_neg.shape != (2 * b,):
            raise ValueError(
                f"loss_pos/loss_neg must be [2B={2 * b}] (the forward on the micro-batch twice); got "
                f"{tuple(loss_pos.shape)}, {tuple(loss_neg.shape)}."
            )
        if weights is not None and weights.shape != r.shape:
            raise ValueError(f"weights must be [K, B] like r {tuple(r.shape)}, got {tuple(weights.shape)}.")
        r = r.detach().to(device=self.gram.device, dtype=self._dtype)
        w = torch.ones_like(r) if weights is None else weights.detach().to(r)
        self._coeffs = scale * torch.cat([w * r, w * (1.0 - r)], dim=1)  # [K, 2B]
        self._fired = 0
        try:
            # Differentiating wrt the dummy leaf runs every tap and computes no parameter gradient.
            torch.autograd.grad(loss_pos[:b].sum() + loss_neg[b:].sum(), [self._dummy], allow_unused=True)
        finally:
            self._coeffs = None
        if self._fired == 0:
            raise RuntimeError("No captured layer received a gradient: run the forward inside engine.capture().")

    # --- the taps (during the engine's backward) ---
    def _on_output_grad(self, site: _Site, x: Tensor | None, dy: Tensor) -> None:
        if self._coeffs is None:
            return
        self._fired += 1
        n = self._coeffs.shape[1]
        if dy.ndim < 1 or dy.shape[0] != n:
            raise RuntimeError(
                f"Layer {site.name!r} sees a batch of {dy.shape[0] if dy.ndim else 0}, the doubled micro-batch is {n}: "
                "the layer_gram engine needs the sample index on dim 0."
            )
        with torch.no_grad():
            if site.kind == "linear":
                self._linear(site, x, dy)
            else:
                self._generic(site, x, dy)

    def _add(self, rows: Tensor) -> None:
        """One slice's K rows: averaged over the processes, then ``gram += R R^T``."""
        if self._reduce is not None:
            self._reduce(rows)
        with ieee_fp32_matmul():  # float32 rows: no TF32 (the release's TF32 Gram carries ~1e-3 relative error)
            self.gram.add_(torch.mm(rows, rows.T).double())

    def _linear(self, site: _Site, x: Tensor | None, dy: Tensor) -> None:
        n, k = self._coeffs.shape[1], self.num_rewards
        coeffs = self._coeffs
        dy3 = dy.reshape(n, -1, dy.shape[-1])  # [2B, N, out]
        out = dy3.shape[-1]
        if site.weight:
            assert x is not None
            x3 = x.reshape(n, -1, x.shape[-1])  # [2B, N, in]
            dtype = torch.promote_types(dy3.dtype, x3.dtype)
            x3 = x3.to(dtype)
            width = x3.shape[-1]
            rows_per_slice = max(1, self._slice // ((n + k) * width))
            for o in range(0, out, rows_per_slice):
                part = dy3[:, :, o : o + rows_per_slice].to(dtype)
                per_sample = torch.bmm(part.transpose(1, 2), x3)  # [2B, rows, in]
                self._add(coeffs @ per_sample.reshape(n, -1).to(coeffs.dtype))
                del per_sample
        if site.bias:
            self._add(coeffs @ dy3.sum(dim=1).to(coeffs.dtype))  # [K, out]

    def _generic(self, site: _Site, x: Tensor, dy: Tensor) -> None:
        # FSDP2 registers the gathered weights on the module for the unit's backward, when the taps run; ZeRO-3's
        # partitions may still be empty then (its pre-backward gather runs after this tap), or in flight (a prefetch):
        # waited for, or gathered here on every process in the same order (the backward's).
        own = list(site.module.parameters(recurse=False))
        wait_in_flight(own, self._module)
        with gathered(not_gathered(own)):
            self._generic_rows(site, x, dy)

    def _generic_rows(self, site: _Site, x: Tensor, dy: Tensor) -> None:
        from torch.func import vjp, vmap
        from torch.nn.utils.stateless import _reparametrize_module

        module = site.module
        values = {name: getattr(module, name).detach() for name in site.names}
        if any(is_dtensor(v) for v in values.values()):
            raise RuntimeError(f"layer_gram: {site.name}'s weights are sharded in its backward (FSDP2 did not gather "
                               "them); train only Linear layers (full_finetune_modules).")  # fmt: skip
        dtype = next(iter(values.values())).dtype
        xs = x.to(dtype) if x.is_floating_point() else x

        def one(x_i: Tensor, dy_i: Tensor) -> dict[str, Tensor]:
            def forward(p: dict[str, Tensor]) -> Tensor:
                # the module's own forward, without its hooks (ZeRO-3's and FSDP2's would gather the weights the
                # reparametrisation replaced): torch.func.functional_call, minus the hooks
                with _reparametrize_module(module, p):
                    return module.forward(x_i.unsqueeze(0)).squeeze(0)

            out, pullback = vjp(forward, values)
            return pullback(dy_i.to(out.dtype))[0]

        self._recomputing = True
        try:
            grads = vmap(one)(xs, dy)  # name -> [2B, *shape]
        finally:
            self._recomputing = False
        per_sample = torch.cat([grads[name].reshape(dy.shape[0], -1) for name in site.names], dim=1)
        width = max(1, self._slice // (per_sample.shape[0] + self.num_rewards))
        for c in range(0, per_sample.shape[1], width):
            self._add(self._coeffs @ per_sample[:, c : c + width].to(self._coeffs.dtype))


def _build_sites(params: list[nn.Parameter], module: nn.Module) -> tuple[list[_Site], list[str]]:
    """The sites holding ``params`` and the names of the parameters no site can take."""
    wanted = {id(p) for p in params}
    sites: dict[int, _Site] = {}
    covered: set[int] = set()
    names: dict[int, str] = {}
    owners: dict[int, set[int]] = {}
    for mod_name, m in module.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in wanted]
        for n, p in own:
            names.setdefault(id(p), f"{mod_name}.{n}" if mod_name else n)
            owners.setdefault(id(p), set()).add(id(m))
        if not own or id(m) in sites:
            continue
        if _is_plain_linear(m):
            kind = "linear"
        elif next(m.children(), None) is None:
            kind = "generic"
        else:
            continue
        sites[id(m)] = _Site(m, mod_name, kind, own)
        covered.update(id(p) for _, p in own)
    covered -= variant_params(module)  # read outside the Linear's forward (DoRA's norm)
    covered -= {pid for pid, mods in owners.items() if len(mods) > 1}  # tied: its calls' gradients must be summed
    unsupported = [
        names.get(id(p), f"params[{i}] (not found in module)") for i, p in enumerate(params) if id(p) not in covered
    ]
    return list(sites.values()), unsupported
