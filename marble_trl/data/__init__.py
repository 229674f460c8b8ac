"""Training and evaluation prompts: prompt files and the group sampler (``prompts.py``), sources mixed into one
dataset (``sources.py``) and the papers' prompt sets by name (``prompt_sets.py``, shipped in ``prompt_data/``)."""
