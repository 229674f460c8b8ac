"""The one place that imports TRL's private trainer bases (pinned range in pyproject.toml).

TRL 1.16 exposes its shared trainer base only as private names; if they move, only this file changes.
"""

from trl.trainer.base_config import _BaseConfig as BaseConfig
from trl.trainer.base_trainer import _BaseTrainer as BaseTrainer

__all__ = ["BaseConfig", "BaseTrainer"]
