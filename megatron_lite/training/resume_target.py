"""train.py --resume's target checked from the command line alone, before DeepSpeed, the data pipeline or any
directory: the kind of directory it names (cheap file tests, no checksums; the full verification stays with the
resume itself, megatron_lite.training.checkpointing.find_resume_checkpoint)."""

from __future__ import annotations

from pathlib import Path

from megatron_lite import checkpoint_dirs

ACCEPTED = ("auto, none, a run dir (holding checkpoints/) or a step dir (checkpoints/step_N with its "
            f"{checkpoint_dirs.COMPLETE_MARKER} marker)")


def check_resume_target(resume: str) -> None:
    """A one-line ValueError unless ``resume`` is auto, none, a run dir with a complete checkpoint or a complete
    step dir; a consolidated or Hugging Face dir is pointed at train.init_from (a run's starting weights)."""
    if resume in ("auto", "none"):
        return
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume {resume}: no such directory; --resume takes {ACCEPTED}")
    try:
        kind = checkpoint_dirs.checkpoint_kind(path)
    except ValueError as error:
        if (path / checkpoint_dirs.CHECKPOINTS_DIR).exists() or list(path.glob("*model_states.pt")):
            raise ValueError(f"--resume {resume}: {error}") from None  # e.g. DeepSpeed's universal dir
        raise ValueError(f"--resume {resume}: not a checkpoint; --resume takes {ACCEPTED}") from None
    if kind in ("consolidated", "hf"):
        what = "a consolidated" if kind == "consolidated" else "a Hugging Face"
        raise ValueError(f"--resume {resume}: {what} dir holds weights only, not a training state to resume; start "
                         f"a run from it with --set train.init_from={resume}; --resume takes {ACCEPTED}")
    if kind == "run":
        if checkpoint_dirs.latest_complete(path / checkpoint_dirs.CHECKPOINTS_DIR) is None:
            raise ValueError(f"--resume {resume}: a run dir without a complete checkpoint in "
                             f"{path / checkpoint_dirs.CHECKPOINTS_DIR}; give an earlier run's dir, or --resume none")
    elif not checkpoint_dirs.is_complete(path):
        raise ValueError(f"--resume {resume}: a step dir without its {checkpoint_dirs.COMPLETE_MARKER} marker "
                         "(its save did not finish); give a complete step dir or the run dir")
