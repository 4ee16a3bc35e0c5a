"""Whether a process on this host still runs: the one check behind taking over a dead run's lock and removing a
dead conversion's staging folder."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host (another user's included)."""
    if pid <= 0:  # a damaged record's; os.kill would address a process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
