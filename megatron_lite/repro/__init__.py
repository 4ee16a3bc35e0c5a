"""Reproduction of the CoCA paper's from-scratch comparison (docs/reproduction.md): profile cpu-tiny (2.9M
models on CPU), the one-GPU speedrun gpu-speedrun and the paper's own 350M run paper-350m.

``pipeline.run_reproduction`` trains the four models of configs/repro/{tiny,speedrun,paper350m}/*.yml
(``training``) and evaluates them; ``settings`` holds the settings, configs and mix file; ``speedrun``
the speedrun's bundle mix, probe and step count; ``paper`` the paper run's launcher, token budget and
its printed arithmetic; ``bundle`` builds and unpacks the speedrun's data bundle;
``report`` writes the paper-layout tables and plots. ``tools/reproduce.py`` is the CLI.
"""

from megatron_lite.repro.pipeline import run_reproduction
from megatron_lite.repro.settings import SCHEMES, ReproSettings
from megatron_lite.repro.training import TrainingFailed

__all__ = ["SCHEMES", "ReproSettings", "TrainingFailed", "run_reproduction"]
