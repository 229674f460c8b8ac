"""ShapesBench: the MARBLE paper's multi-reward evidence at CPU scale, in a procedurally drawn world with real scorers.

- :mod:`.world`: captioned 32 x 32 images of coloured shapes (colour, count, position and general prompt families);
- :mod:`.scorers`: classical-vision rewards (general: sharpness, compressibility; specialist: color, count, position);
- :mod:`.pretrain`: the base model, a tiny SD3.5-architecture pipeline pretrained by flow matching, cached;
- :mod:`.methods`, :mod:`.bench`: the compared training methods and the benchmark runner;
- :mod:`.report`: Table 1 / Table S1 / Table 2 and plots (:mod:`.plots`), from the run records (:mod:`.records`).

Command line: ``python -m marble_trl.shapesbench {pretrain,run,report}`` (or ``python benchmarks/shapesbench.py``);
see ``docs/shapesbench.md``.
"""

from .scorers import GENERAL_REWARDS, REWARD_NAMES, REWARDS, SPECIALIST_REWARDS, score_all
from .world import Scene, all_scenes, eval_scenes, prompt_dataset, render

__all__ = [
    "GENERAL_REWARDS",
    "REWARDS",
    "REWARD_NAMES",
    "SPECIALIST_REWARDS",
    "Scene",
    "all_scenes",
    "eval_scenes",
    "prompt_dataset",
    "render",
    "score_all",
]
