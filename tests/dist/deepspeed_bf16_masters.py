"""Worker for test_precision: real DeepSpeed bf16 engines over the tiny transformer's LoRA (ZeRO-2), then over its
own weights (full fine-tuning, ZeRO-2 and ZeRO-3), on three CPU processes: DeepSpeed's partitions then cut weights
across processes (a process may own no piece of a weight yet must join the collectives that read it), and ZeRO-3 pads
partitions of weights whose size three does not divide.

DeepSpeed casts every module parameter to bf16 and keeps float32 masters of the trainable ones in its optimizer.
Checks that ``master_weights`` reads those masters, and that ``OldPolicy`` and ``LoraEMA`` follow their float32
formulas from them over several optimizer steps, while the module's old adapter is the master rounded to bf16; then
that a full fine-tune's ``FullPolicy`` and ``FullEMA`` do the same, that its old policy and reference swap in as bf16
(the module's dtype: DeepSpeed runs it without autocast) and the swap restores DeepSpeed's own tensors, and that
``transformer/`` is written from the masters.
Every process feeds the same inputs, so every process must reach the same values. Exits non-zero (an
AssertionError) on failure. Run: python -m torch.distributed.run --nproc_per_node 3 deepspeed_bf16_masters.py
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from peft import LoraConfig  # noqa: E402

from marble_trl.models import load_sd3_pipeline  # noqa: E402
from marble_trl.policy.full import FullEMA, FullPolicy  # noqa: E402
from marble_trl.policy.full_shards import valid  # noqa: E402
from marble_trl.policy.lora import LoraEMA, OldPolicy, add_policy_adapters, lora_parameters, master_weights  # noqa: E402

ETA, DECAY, STEPS = 0.999, 0.9, 4
PADDED: list[bool] = []  # per ZeRO-3 trained weight: whether its partitions carry padding
EPS32 = torch.finfo(torch.float32).eps


def old_name(name: str) -> str:
    return name.replace(".default.", ".old.")


CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
}


def step(engine, gen: torch.Generator) -> None:
    out = engine(**_inputs(gen), return_dict=False)[0]
    engine.backward(out.float().square().mean())
    engine.step()


def lora_main() -> None:
    torch.manual_seed(0)
    transformer = load_sd3_pipeline("tiny").transformer
    add_policy_adapters(
        transformer,
        LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["attn.to_q", "attn.to_v"]),
    )
    train = lora_parameters(transformer, "default")
    old = lora_parameters(transformer, "old")
    ema = LoraEMA(transformer)
    optimizer = torch.optim.SGD(list(train.values()), lr=0.5)
    engine, *_ = deepspeed.initialize(
        model=transformer, model_parameters=list(train.values()), optimizer=optimizer, config=CONFIG
    )
    assert {p.dtype for p in [*train.values(), *old.values()]} == {torch.bfloat16}, "DeepSpeed bf16 casts the module"

    policy = OldPolicy()
    exact_old = {n: old[old_name(n)].detach().double().clone() for n in train}
    exact_ema = {n: t.double().clone() for n, t in ema.state_dict().items()}
    # the EMA started from the float32 init; DeepSpeed's master starts from its bf16 rounding
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        step(engine, gen)
        masters = master_weights(train)
        for n, p in train.items():
            full = safe_get_full_fp32_param(p)
            assert masters[n].dtype == torch.float32 and torch.equal(masters[n], full), n
        policy.update(transformer, ETA)
        ema.update(transformer, DECAY)
        for n in train:
            exact_old[n] = ETA * exact_old[n] + (1 - ETA) * masters[n].double()
            exact_ema[n] = DECAY * exact_ema[n] + (1 - DECAY) * masters[n].double()
    moved = max((masters[n] - masters[n].bfloat16().float()).abs().max().item() for n in train)
    assert moved > 0, "the masters hold values no bf16 weight can: the test would be vacuous otherwise"
    state = policy.master_state()
    assert state is not None
    for n in train:
        scale = max(exact_old[n].abs().max().item(), 1e-30)
        assert (state[old_name(n)].double() - exact_old[n]).abs().max().item() <= 4 * STEPS * EPS32 * scale, n
        assert torch.equal(old[old_name(n)].detach(), state[old_name(n)].bfloat16()), n
        ema_scale = max(exact_ema[n].abs().max().item(), 1e-30)
        assert (ema.state_dict()[n].double() - exact_ema[n]).abs().max().item() <= 4 * STEPS * EPS32 * ema_scale, n


def full_main(stage: int) -> None:
    """Full fine-tuning of the attention's query and value weights under a ZeRO-``stage`` bf16 engine (ZeRO-3: every
    weight partitioned, the copies held as partitions and swapped into ``ds_tensor``)."""
    torch.manual_seed(0)
    transformer = load_sd3_pipeline("tiny").transformer
    policy = FullPolicy(transformer, ["attn.to_q", "attn.to_v"])
    train = policy.trainable(transformer)
    ema = FullEMA(transformer)
    optimizer = torch.optim.SGD(list(train.values()), lr=0.5)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    engine, *_ = deepspeed.initialize(
        model=transformer,
        model_parameters=list(train.values()),
        optimizer=optimizer,
        config={**CONFIG, "zero_optimization": zero},
    )
    policy.release = engine.optimizer.empty_partition_cache if stage == 3 else None  # the trainer's backend's
    if stage == 3:
        world = torch.distributed.get_world_size()
        PADDED.extend(p.ds_numel % world != 0 for p in train.values())
    assert {p.dtype for p in train.values()} == {torch.bfloat16}, "DeepSpeed bf16 casts the module"
    assert all(hasattr(p, "ds_tensor") for p in train.values()) == (stage == 3)
    exact_old = {n: t.double().clone() for n, t in policy.old.items()}
    exact_ema = {n: t.double().clone() for n, t in ema.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        step(engine, gen)
        masters = master_weights(train)
        policy.update(transformer, ETA)
        ema.update(transformer, DECAY)
        for n in train:
            exact_old[n] = ETA * exact_old[n] + (1 - ETA) * masters[n].double()
            exact_ema[n] = DECAY * exact_ema[n] + (1 - DECAY) * masters[n].double()
    assert max((masters[n] - masters[n].bfloat16().float()).abs().max().item() for n in train) > 0
    old, shadow = policy.master_state(transformer), ema.state_dict(transformer)  # whole (gathered under ZeRO-3)
    for n in train:
        scale = max(exact_old[n].abs().max().item(), 1e-30)
        assert policy.old[n].dtype == torch.float32
        assert (old[n].double() - exact_old[n]).abs().max().item() <= 4 * STEPS * EPS32 * scale, n
        ema_scale = max(exact_ema[n].abs().max().item(), 1e-30)
        assert (shadow[n].double() - exact_ema[n]).abs().max().item() <= 4 * STEPS * EPS32 * ema_scale, n
    # the swaps: the old policy rounded to the module's bf16 (its float32 copy untouched), the reference (the loaded
    # float32 weights, rounded as well); DeepSpeed's own tensors back afterwards (ZeRO-2: the views into its flat
    # buffer; ZeRO-3: the partitions' values)
    before = {n: (p.data_ptr(), p.detach().clone(), _partition(p)) for n, p in train.items()}
    for use, weights in ((policy.use_old, policy.old), (policy.use_reference, policy.reference)):
        with use(transformer):
            whole = policy.shards.whole(weights, train)
            with deepspeed.zero.GatheredParameters(list(train.values()) if stage == 3 else []):
                for n, p in train.items():
                    assert p.dtype == torch.bfloat16 and torch.equal(p.detach().cpu(), whole[n].bfloat16()), n
            assert torch.isfinite(transformer(**_inputs(gen), return_dict=False)[0]).all()  # runs without autocast
        for n, p in train.items():
            if stage == 3:
                assert torch.equal(_partition(p), before[n][2]), n
            else:
                assert p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]), n
    # transformer/ is written from the float32 masters; the frozen weights as the module holds them
    state = policy.saved_state(transformer)
    assert state is not None
    for n in train:
        assert state[n].dtype == torch.float32 and torch.equal(state[n], masters[n].cpu()), n
    frozen, param = next((n, p) for n, p in transformer.named_parameters() if n not in train)
    with deepspeed.zero.GatheredParameters([param] if stage == 3 else []):
        assert state[frozen].shape == param.shape and torch.equal(state[frozen], param.detach().cpu())


def _partition(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This process's ZeRO-3 partition without its padding (DeepSpeed fills that from uninitialised memory: it may
    hold NaNs, which no comparison equals)."""
    return valid(param.ds_tensor, param).detach().clone() if hasattr(param, "ds_tensor") else None


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "hidden_states": torch.randn(2, 4, 16, 16, generator=gen).bfloat16(),
        "timestep": torch.tensor([500.0, 300.0]),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=gen).bfloat16(),
        "pooled_projections": torch.randn(2, 64, generator=gen).bfloat16(),
    }


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    lora_main()
    full_main(stage=2)
    full_main(stage=3)
    if torch.distributed.get_rank() == 0:
        padded = [p for p in PADDED if p]
        assert padded, "no ZeRO-3 partition was padded: the padding path went untested"
        print("ok")
    torch.distributed.destroy_process_group()
