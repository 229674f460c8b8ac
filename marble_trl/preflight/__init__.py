"""``marble-trl check``'s pieces (docs/check.md): the published architectures built on the meta device
(:mod:`.architectures`, shared with the memory benchmarks), our measured activations (:mod:`.measurements`,
``measured_memory.json``), the memory arithmetic per strategy (:mod:`.memory`) and its fixes (:mod:`.fixes`), the model
and reward checks (:mod:`.model`, :mod:`.rewards`), the steps after the parse (:mod:`.run`), the optional GPU
measurement (:mod:`.measure`) and the report (:mod:`.report`). The command is :mod:`marble_trl.commands.check`."""
