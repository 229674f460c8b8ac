"""Evaluation: deterministic images for a prompt set scored by rewards (``run.py``), score summaries across models
(``scores.py``) and the image sheets a person reads (``samples.py``)."""
