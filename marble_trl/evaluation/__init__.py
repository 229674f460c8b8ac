"""Evaluation: deterministic images for a prompt set (``images.py``) scored by rewards (``run.py``: ``marble-trl
evaluate``), their summaries and results files (``results.py``), score statistics across models (``scores.py``) and the
image sheets a person reads (``samples.py``, their text laid out by ``text_layout.py``)."""
