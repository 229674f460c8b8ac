"""``marble-trl`` under FSDP2 on CPU processes (gloo), for the tests: python -m accelerate.commands.launch
--config_file recipes/accelerate/fsdp2.yaml --num_processes 2 tests/dist/fsdp_cpu.py train ARGS...

accelerate selects FSDP only on accelerator devices (its ``AcceleratorState`` sets ``DistributedType.FSDP`` inside
the multi-GPU / NPU / XPU branch; CPU processes become ``MULTI_CPU``), though torch's ``fully_shard`` runs on CPU
meshes over gloo. This shim turns a ``MULTI_CPU`` state into ``FSDP`` with the launcher's plugin, which is what
accelerate does on GPUs, and runs the CLI unchanged: every FSDP code path of accelerate and marble_trl then runs.

After training, each process writes ``<output_dir>/rank<R>.json``: its balancer state, the sizes of its own shards
of the trainable LoRA and whether the root-level ``proj_out`` LoRA layer is an FSDP unit of its own.
"""

import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        # Every later AcceleratorState() copies PartialState's fields over its own: FSDP there too.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


AcceleratorState.__init__ = _init_fsdp_on_cpu


def _describe(trainer) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = trainer.trainable_parameters()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params.values()]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": sum(isinstance(p, DTensor) for p in params.values()),
        "params": len(params),
        "local_numel": sum(t.numel() for t in local),
        "numel": sum(p.numel() for p in params.values()),
        "proj_out_unit": isinstance(getattr(trainer.transformer, "proj_out", None), FSDPModule),
    }


if __name__ == "__main__":
    from rank_dump import dump_after_training

    from marble_trl.cli import main

    dump_after_training(_describe)
    sys.exit(main(sys.argv[1:]))
