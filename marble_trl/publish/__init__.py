"""Publishing: checkpoint -> LoRA folder and images from it (``export.py``), model cards and the Hub (``hub.py``)."""
