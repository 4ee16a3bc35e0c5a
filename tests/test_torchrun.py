"""The guide's `torchrun` commands (docs/run_at_scale.md, "torchrun") through torch's and train.py's parsers.

The 2-rank torchrun run itself (the `deepspeed` launcher's losses; a SIGTERM saves on every rank and run_lock
exits 143) shares its uninterrupted reference with the SLURM test: tests/test_slurm_requeue.py.
"""

from __future__ import annotations

import re
import shlex

from training_helpers import REPO

DOCS = REPO / "docs" / "run_at_scale.md"


def documented_torchrun_commands() -> list[list[str]]:
    """The `torchrun ...` lines of the guide's ```bash blocks, continuations joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split(" # ", 1)[0])
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if words[:1] == ["torchrun"]:
                commands.append(words[1:])
    return commands


def test_documented_torchrun_commands_parse() -> None:
    """Each documented torchrun command through torch's own parser, and its train.py arguments through train.py's:
    one node (--standalone) and two (--nnodes 2, a c10d rendezvous), both with a --shutdown-timeout."""
    from torch.distributed.run import get_args_parser

    from script_loading import load_script

    train_parser = load_script("train.py").build_parser()
    parsed = [get_args_parser().parse_args(words) for words in documented_torchrun_commands()]
    assert any(args.standalone for args in parsed), "a single-node command"
    assert any(args.nnodes == "2" and args.rdzv_backend == "c10d" and args.rdzv_endpoint for args in parsed)
    for args in parsed:
        assert args.training_script == "train.py" and args.shutdown_timeout is not None
        train_parser.parse_args(args.training_script_args)
