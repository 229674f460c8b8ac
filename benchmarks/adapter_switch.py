"""Cost of the adapter switches of one training timestep (old policy, then the KL reference, and back): diffusers'
model-level ``set_adapter`` / ``enable_adapters`` (which walk every module) against ``marble_trl.policy.lora``'s cached
switch, side by side in one process, on the shipped ``shapes`` transformer with the ShapesBench LoRA.

    python benchmarks/adapter_switch.py [--rounds 5] [--calls 50]

Prints each round's milliseconds per timestep and the median ratio (model-level / cached).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from peft import LoraConfig

from marble_trl.models import load_sd3_pipeline
from marble_trl.policy import lora
from marble_trl.shapesbench.bench import LORA_TARGETS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(1)
    t = load_sd3_pipeline("shapes").transformer
    lora.add_policy_adapters(t, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))

    def model_level() -> None:
        t.set_adapter(lora.OLD_ADAPTER)
        t.set_adapter(lora.TRAIN_ADAPTER)
        lora._set_trainable(t)
        t.disable_adapters()
        t.enable_adapters()
        t.set_adapter(lora.TRAIN_ADAPTER)
        lora._set_trainable(t)

    def cached() -> None:
        with lora.use_old_policy(t):
            pass
        with lora.use_reference(t):
            pass

    def ms(f) -> float:
        f()
        start = time.perf_counter()
        for _ in range(a.calls):
            f()
        return (time.perf_counter() - start) / a.calls * 1000

    ratios = []
    for r in range(a.rounds):  # interleaved: a busy machine slows both alike within a round
        before, after = ms(model_level), ms(cached)
        ratios.append(before / after)
        print(f"round {r}: model-level {before:.2f} ms, cached {after:.2f} ms per timestep ({before / after:.2f}x)")
    print(f"median speed-up of the switches: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
