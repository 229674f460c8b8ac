"""The ``marble-trl`` subcommands, one module each (``marble_trl.cli`` parses the command and dispatches)."""
