"""``marble-trl`` under FSDP2 on CPU processes (gloo), for the tests: python -m accelerate.commands.launch
--config_file recipes/accelerate/fsdp2.yaml --num_processes 2 tests/dist/fsdp_cpu.py train ARGS...

accelerate selects FSDP only on accelerator devices (its ``AcceleratorState`` sets ``DistributedType.FSDP`` inside
the multi-GPU / NPU / XPU branch; CPU processes become ``MULTI_CPU``), though torch's ``fully_shard`` runs on CPU
meshes over gloo. This shim turns a ``MULTI_CPU`` state into ``FSDP`` with the launcher's plugin, exactly what
accelerate does on GPUs, and runs the CLI unchanged; every FSDP code path of accelerate and marble_trl then runs.
"""

import sys

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init_fsdp_on_cpu

if __name__ == "__main__":
    from marble_trl.cli import main

    sys.exit(main(sys.argv[1:]))
