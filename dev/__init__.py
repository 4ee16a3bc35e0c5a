"""Development instruments that predict GPU figures on a CPU (dev/README.md). Not installed: run from the
repository root (``python -m dev.cpu_figures ...``); the tests import it from the checkout (tests/conftest.py)."""
