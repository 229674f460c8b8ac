"""Rollouts: each ``sample_scheduler`` as a diffusers scheduler on the family's training grid (``solvers.py``) and
DiffusionNFT's multistep DPM-Solver (``dpm_solver.py``)."""
