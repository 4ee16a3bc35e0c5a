"""Reproduction of the CoCA paper's from-scratch comparison (docs/reproduction.md): profile cpu-tiny
(issue 8) and the one-GPU speedrun gpu-speedrun (issue 19).

``pipeline.run_reproduction`` trains the four models of configs/repro/{tiny,speedrun}/*.yml
(``training``) and evaluates them; ``settings`` holds the settings, configs and mix file; ``speedrun``
the speedrun's bundle mix, probe and step count; ``bundle`` builds and unpacks its data bundle;
``report`` writes the paper-layout tables and plots. ``tools/reproduce.py`` is the CLI.
"""

from megatron_lite.repro.pipeline import run_reproduction
from megatron_lite.repro.settings import SCHEMES, ReproSettings
from megatron_lite.repro.training import TrainingFailed

__all__ = ["SCHEMES", "ReproSettings", "TrainingFailed", "run_reproduction"]
