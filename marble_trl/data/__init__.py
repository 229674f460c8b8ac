"""Training and evaluation prompts: prompt files and the group sampler (``prompts.py``), sources mixed into one
dataset (``sources.py``, reading table files with ``table_files.py``) and the papers' prompt sets by name
(``prompt_sets.py``, shipped in ``prompt_data/``; their cached, verified files: ``prompt_files.py``)."""
