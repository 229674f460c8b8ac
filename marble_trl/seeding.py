"""Seeds derived from a tuple of integers, identical on every process and every run.

Python's ``hash`` of a tuple of ints is not randomised (``PYTHONHASHSEED`` affects only str/bytes), so the same keys
give the same seed everywhere. The trainer keys its noise by (run seed, step, global micro-batch), the group sampler
its per-source streams by (seed, epoch, source), evaluation its images by (eval seed, prompt, image).
"""

from __future__ import annotations

import torch


def derived_seed(*keys: int) -> int:
    """A non-negative 63-bit seed determined by ``keys``."""
    return hash(tuple(int(k) for k in keys)) % (2**63)


def keyed_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded with :func:`derived_seed` of ``keys``."""
    return torch.Generator().manual_seed(derived_seed(*keys))
