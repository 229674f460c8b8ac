"""One optimizer step's plan: rollouts, rewards gathered in the global sampler order, the step's mode and single advantage,
and the micro-batches that the timestep loop (:mod:`.backward`) trains on.

The rule that maps micro-batches to processes lives here only: accelerate hands global batch ``j`` to process
``j % world``, so process ``p``'s ``m``-th micro-batch is global batch ``m * world + p``. Every random draw of a step
is keyed by that global index (:func:`global_batch_index`), so 1 process with gradient accumulation and N processes
with the same global batch draw the same noise, and a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from accelerate.utils import gather, gather_object

from ..balance import MarbleBalancer, ReleasedMarble
from ..models import Conditioning
from ..models.editing import source_kwargs

StepMode = Literal["plain", "cosines", "refresh", "solve_first", "amortised", "pairwise"]


def encode_prompts_and_negative(
    adapter, prompts: list[str], args, device, source_images: torch.Tensor | None = None
) -> tuple[Conditioning, Conditioning | None]:
    """The prompts' conditioning, and the negative prompt's when the family uses CFG and ``guidance_scale > 1``; an
    editing family's both see the rows' ``source_images``."""
    sources = source_kwargs(adapter, source_images)
    embeds = adapter.encode(prompts, args.max_sequence_length, device, args.guidance_scale, **sources)
    negative = None
    if adapter.needs_negative(args.guidance_scale):
        negative = adapter.encode([args.negative_prompt] * len(prompts), args.max_sequence_length, device, **sources)
    return embeds, negative


def rollouts(
    adapter, scheduler, embeds, negative, micro: int, count: int, args, generator: Callable[[int], torch.Generator]
):
    """The step's rollouts, ``count`` micro-batches of ``micro`` prompts (call under the old-policy adapter):
    clean latents (float32) and decoded images; ``generator(m)`` seeds micro-batch ``m``'s initial noise."""
    latents, images = [], []
    for m in range(count):
        sl = slice(m * micro, (m + 1) * micro)
        x0 = adapter.sample(
            scheduler,
            embeds.index(sl),
            args.num_sample_steps,
            args.resolution,
            generator(m),
            args.guidance_scale,
            negative.index(sl) if negative is not None else None,
        )
        latents.append(x0.float())
        images.append(adapter.decode(x0))
    return torch.cat(latents), torch.cat(images)


def global_batch_index(micro_batch: int, world: int, rank: int) -> int:
    """The global index of process ``rank``'s ``micro_batch``-th micro-batch (accelerate: global ``j`` -> ``j % world``)."""
    return micro_batch * world + rank


def global_positions(local_index: torch.Tensor, ranks: torch.Tensor | int, micro: int, world: int) -> torch.Tensor:
    """The global sampler position of sample ``local_index`` of process ``ranks`` (micro-batches of ``micro``)."""
    return global_batch_index(local_index // micro, world, ranks) * micro + local_index % micro


@dataclass(frozen=True)
class GatheredRewards:
    """The step's rewards of every process, in the global sampler order."""

    rewards: torch.Tensor  # [K, N_global]
    local_positions: torch.Tensor  # [N_local]: this process's samples' global positions
    sources: list[Any] | None  # each sample's prompt source, or None without a source column


class PeerFailure(RuntimeError):
    """Raised on every process that did not fail itself when another process failed at the same point of the step
    (see :func:`fail_together`)."""


def run_together(accelerator, where: str, work: Callable[[], Any]) -> Any:
    """``work()``, with its failure on any process raised on every process (:func:`fail_together`)."""
    failure, result = None, None
    try:
        result = work()
    except Exception as error:  # every process hears of it before the next collective and stops with it
        failure = error
    fail_together(accelerator, failure, where)
    return result


def fail_together(accelerator, error: BaseException | None, where: str) -> None:
    """With several processes, a failure on one of them (a reward server down for one rank) would leave the others
    waiting in the next collective until the launcher kills them. Every process reaches this point and agrees:
    when any failed, all raise here together (the failed ones their own error, the others :class:`PeerFailure`),
    each marked ``all_processes``, so the emergency checkpoint can still be written (a save is collective)."""
    if accelerator.num_processes > 1:
        flag = torch.tensor([0 if error is None else accelerator.process_index + 1], device=accelerator.device)
        failed = [int(r) - 1 for r in gather(flag).cpu().tolist() if r > 0]
        if failed and error is None:
            error = PeerFailure(
                f"process {failed[0]} failed while {where} (its error is in its log); every process stops here."
            )
        if error is not None:
            error.all_processes = True
    if error is not None:
        raise error


def gather_rewards(
    accelerator, rewards_local: torch.Tensor, prompts: list[str], micro: int, num_generations: int, sources=None
) -> GatheredRewards:
    """Gather the step's rewards (and the samples' sources, if given) from every process in the global sampler
    order. Groups of ``num_generations`` consecutive samples in that order share a prompt; this is checked, since a
    group split wrongly would silently corrupt the advantages."""
    world, rank = accelerator.num_processes, accelerator.process_index
    n_local = rewards_local.shape[1]
    local_idx = torch.arange(n_local)
    positions = global_positions(local_idx, rank, micro, world)
    if world == 1:
        all_rewards, all_prompts, all_positions, all_sources = rewards_local, prompts, positions, sources
    else:
        all_rewards = gather(rewards_local.T.contiguous().to(accelerator.device)).cpu().T
        all_prompts = gather_object(prompts)
        all_sources = gather_object(sources) if sources is not None else None
        all_positions = global_positions(
            local_idx.repeat(world), torch.arange(world).repeat_interleave(n_local), micro, world
        )
    ordered = torch.empty_like(all_rewards)
    ordered[:, all_positions] = all_rewards
    slots = all_positions.tolist()

    def in_order(values: list[Any]) -> list[Any]:
        out = [None] * len(values)
        for pos, value in zip(slots, values):
            out[pos] = value
        return out

    check_groups(in_order(all_prompts), num_generations)
    return GatheredRewards(ordered, positions, in_order(all_sources) if all_sources is not None else None)


def check_groups(prompts: list[str], num_generations: int) -> None:
    for start in range(0, len(prompts), num_generations):
        group = prompts[start : start + num_generations]
        if any(p != group[0] for p in group):
            raise RuntimeError(
                f"A group of {num_generations} samples mixes prompts ({sorted(set(group))[:3]}...): the data sharding "
                "does not keep groups together. Use the trainer's own dataloader (GroupSampler)."
            )


@dataclass(frozen=True)
class StepPlan:
    """How this step's gradient is formed.

    - ``"plain"``: one backward of the NFT loss with ``advantages`` (one reward, or a weighted-sum baseline);
    - ``"cosines"``: the same update, plus the K per-reward gradients for the Table S1 diagnostics;
    - ``"refresh"``: a MARBLE refresh step (per-reward gradients, QP, Eq. 7 written into ``.grad``);
    - ``"solve_first"``: a MARBLE refresh whose per-reward gradients come first, from a subset of the step's
      (micro-batch, timestep) pairs or all of them (:mod:`.solve_first`), and whose Eq. 7 update is then one ordinary
      backward by Prop. 1; the step continues as ``"plain"`` (or ``"cosines"``) with the solved coefficients;
    - ``"amortised"``: a MARBLE step between refreshes: ``A = sum_k (c_k / sum c) A_k`` (Prop. 1);
    - ``"pairwise"``: the released MARBLE (``marble_procedure="released"``): each (micro-batch, timestep) pair is solved
      or amortised on its own (:mod:`.pairwise`); ``advantages`` is unused.
    """

    mode: StepMode
    advantages: torch.Tensor  # [N_global]: the single advantage of the step's ordinary backward
    has_signal: torch.Tensor  # [K] bool: some advantage of the reward is non-zero this step
    policy_scale: float = 1.0  # the factor on the NFT policy term of the ordinary backward (sum_k c_k; not KL)

    @property
    def needs_engine(self) -> bool:
        """Whether the step computes the K per-reward gradients."""
        return self.mode in ("refresh", "cosines")


def plan_step(
    per_reward: torch.Tensor,
    combined: torch.Tensor,
    balancer: MarbleBalancer | ReleasedMarble | None,
    step: int,
    *,
    log_update_cosines: bool,
    adv_clip_max: float,
    solve_first: bool = False,
) -> StepPlan:
    """The step's :class:`StepPlan` from its advantages ([K, N] per reward, [N] combined by the aggregation);
    ``solve_first``: refreshes solve before the step's backward passes (``marble_refresh_subset``, DeepSpeed)."""
    # A reward whose advantages are all 0 this step (no spread, or not applicable anywhere) has no signal: its
    # "gradient" would only be that of 0.5 (L_pos + L_neg). MARBLE leaves it out of the QP (zero buffer row); the
    # cosine diagnostics leave it out of the harmony statistics.
    has_signal = (per_reward != 0).any(dim=1)
    if balancer is None:
        return StepPlan("cosines" if log_update_cosines else "plain", combined, has_signal)
    if isinstance(balancer, ReleasedMarble):  # each pair decides for itself (trainer/pairwise.py)
        return StepPlan("pairwise", combined, has_signal)
    weights = balancer.plan(step, per_reward, adv_clip_max, has_signal)
    if weights.refresh:
        mode = "solve_first" if solve_first else "refresh"  # ("advantage" refreshes train on the pre-refresh c)
        return StepPlan(mode, weights.advantages, has_signal, weights.policy_scale)
    # Amortised steps with diagnostics: the same update, plus the K gradients for cos(update, g_k).
    mode = "cosines" if log_update_cosines else "amortised"
    return StepPlan(mode, weights.advantages, has_signal, weights.policy_scale)


@dataclass(frozen=True, eq=False)  # identity: fields are tensors
class MicroBatch:
    """One micro-batch of rollouts, as ``training_step`` receives it. Immutable: a re-planned step gets new ones
    (``dataclasses.replace``; :class:`~marble_trl.trainer.session.StepSession`)."""

    x0: torch.Tensor  # [B, C, h, w] clean latents
    embeds: Conditioning
    advantages: torch.Tensor  # [B] the plan's single advantage
    per_reward_advantages: torch.Tensor  # [K, B]
    timestep_index: torch.Tensor  # [B, T] indices into the training sigmas
    index: int  # this process's micro-batch number in the step
    last: bool  # the step's last micro-batch
    plan: StepPlan
    # A solved-first refresh trains on re-planned advantages; its logged loss stays that of the step as planned
    # (advantages, policy_scale), as on every back-end (docs/metrics.md, `loss`). None: the trained one.
    reported: tuple[torch.Tensor, float] | None = None
    applicable: torch.Tensor | None = None  # [K, B] bool: where each reward applies (its reward is not None)
    # A masked solve's phase-2 update (solve_first with marble_masked_solve): per-sample weights (on L_pos, on L_neg)
    # of the policy term instead of the advantages (nft.nft_weighted_loss).
    loss_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def __contains__(self, key: str) -> bool:  # transformers probes inputs for "input_ids" (token and FLOP counts)
        return key in {f.name for f in fields(self)}


def make_micro_batches(
    x0: torch.Tensor,
    embeds: Conditioning,
    plan: StepPlan,
    per_reward: torch.Tensor,
    local_positions: torch.Tensor,
    micro: int,
    count: int,
    num_sigmas: int,
    num_train: int,
    generator: Callable[[int], torch.Generator],
    device: torch.device,
    applicable: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """This process's ``count`` micro-batches of ``micro`` samples; ``generator(m)`` seeds micro-batch ``m``'s choice of training timesteps (a random
    ``num_train`` of the ``num_sigmas`` for each sample)."""
    combined = plan.advantages[local_positions]
    per_reward = per_reward[:, local_positions]
    if applicable is not None:  # [K, N_global] -> this process's samples
        applicable = applicable[:, local_positions]
    out = []
    for m in range(count):
        sl = slice(m * micro, (m + 1) * micro)
        perm_gen = generator(m)
        perms = torch.stack([torch.randperm(num_sigmas, generator=perm_gen) for _ in range(micro)])
        out.append(
            MicroBatch(
                x0=x0[sl],
                embeds=embeds.index(sl),
                advantages=combined[sl].to(device),
                per_reward_advantages=per_reward[:, sl].to(device),
                timestep_index=perms[:, :num_train],
                index=m,
                last=m == count - 1,
                plan=plan,
                applicable=None if applicable is None else applicable[:, sl].to(device),
            )
        )
    return out
