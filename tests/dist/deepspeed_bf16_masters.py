"""Worker for test_precision: a real DeepSpeed ZeRO-2 bf16 engine (1 CPU process) over the tiny transformer's LoRA.

DeepSpeed casts every module parameter to bf16 and keeps float32 masters of the trainable ones in its optimizer.
Checks that ``master_weights`` reads those masters, and that ``OldPolicy`` and ``LoraEMA`` follow their float32
formulas from them over several optimizer steps, while the module's old adapter is the master rounded to bf16.
Exits non-zero (an AssertionError) on failure. Run: python deepspeed_bf16_masters.py PORT
"""

import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from peft import LoraConfig  # noqa: E402

from marble_trl.policy.lora import LoraEMA, OldPolicy, add_policy_adapters, lora_parameters, master_weights  # noqa: E402
from marble_trl.models import load_sd3_pipeline  # noqa: E402

ETA, DECAY, STEPS = 0.999, 0.9, 4
EPS32 = torch.finfo(torch.float32).eps


def old_name(name: str) -> str:
    return name.replace(".default.", ".old.")


def main() -> None:
    torch.manual_seed(0)
    transformer = load_sd3_pipeline("tiny").transformer
    add_policy_adapters(
        transformer,
        LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["attn.to_q", "attn.to_v"]),
    )
    train = lora_parameters(transformer, "default")
    old = lora_parameters(transformer, "old")
    ema = LoraEMA(transformer)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(list(train.values()), lr=0.5)
    engine, *_ = deepspeed.initialize(
        model=transformer, model_parameters=list(train.values()), optimizer=optimizer, config=config
    )
    assert {p.dtype for p in [*train.values(), *old.values()]} == {torch.bfloat16}, "DeepSpeed bf16 casts the module"

    policy = OldPolicy()
    exact_old = {n: old[old_name(n)].detach().double().clone() for n in train}
    exact_ema = {n: t.double().clone() for n, t in ema.state_dict().items()}
    # the EMA started from the float32 init; DeepSpeed's master starts from its bf16 rounding
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(2, 4, 16, 16, generator=gen).bfloat16()
        embeds, pooled = torch.randn(2, 6, 32, generator=gen).bfloat16(), torch.randn(2, 64, generator=gen).bfloat16()
        out = engine(
            hidden_states=x,
            timestep=torch.tensor([500.0, 300.0]),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        engine.backward(out.float().square().mean())
        engine.step()
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
    print("ok")


if __name__ == "__main__":
    main()
