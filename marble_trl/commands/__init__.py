"""The ``marble-trl`` subcommands, one module each (``marble_trl.cli`` parses the command and dispatches), and
``launch.py``: re-running ``marble-trl train`` under ``accelerate launch``."""
