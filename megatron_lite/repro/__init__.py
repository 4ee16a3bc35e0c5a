"""Tiny-scale reproduction of the CoCA paper on CPU (issue 8; docs/reproduction.md).

``pipeline.run_reproduction`` trains the four models of configs/tiny/repro_*.yml (``training``) and
evaluates them; ``settings`` holds the settings, configs and mix file; ``report`` writes the
paper-layout tables and plots. ``tools/reproduce_tiny.py`` is the CLI.
"""

from megatron_lite.repro.pipeline import run_reproduction
from megatron_lite.repro.settings import SCHEMES, ReproSettings
from megatron_lite.repro.training import TrainingFailed

__all__ = ["SCHEMES", "ReproSettings", "TrainingFailed", "run_reproduction"]
