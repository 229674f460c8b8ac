"""Publishing: checkpoint -> LoRA folder and images from it (``export.py``), the model card (``card.py``), a run
folder's ``marble_trl.json`` (``run_info.py``) and the Hub (``hub.py``)."""
