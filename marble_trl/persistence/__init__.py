"""What outlives a process: checkpoints written atomically (``checkpoint.py``), safe resume (``resume.py``), one run per
output folder (``output_dir.py``) and best-checkpoint selection (``best.py``)."""
