"""The policy being trained: its LoRA adapters, old policy and parameter EMA (``lora.py``) and DiffusionNFT's
objective (``nft.py``)."""
