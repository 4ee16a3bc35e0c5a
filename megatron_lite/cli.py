"""What every command line shares: a user error is one line, ``error: MESSAGE``, never a traceback.

A script decorates its ``main(argv=None) -> int`` with ``@cli_main`` and ends with
``if __name__ == "__main__": run_cli(main)``::

    @cli_main
    def main(argv: list[str] | None = None) -> int:
        args = parser.parse_args(argv)
        ...  # raise ValueError("what is wrong, and the value") for anything the user can fix
        return 0

A ``ValueError`` (bad key, file or value) prints ``error: MESSAGE`` on stderr and makes ``main``
return ``EXIT_USER_ERROR``; anything else is a bug and keeps its traceback. Under a launcher (``deepspeed``,
``torchrun``: RANK set) only rank 0 prints it; the others exit with the same code, silently. Every rank checks
the same config and command line, and what only rank 0 does (data preparation, a universal conversion) fails on
the others as "see rank 0's message", so rank 0's line names the problem. A ValueError that a rank other than 0
met alone shows no line (the launcher still reports that rank's exit code).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from collections.abc import Callable
from typing import NoReturn, ParamSpec

from megatron_lite.console import is_main_rank, show_notices

EXIT_USER_ERROR = 2  # as argparse exits for a bad command line

P = ParamSpec("P")


def print_error(error: BaseException | str) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)


def cli_main(main: Callable[P, int | None]) -> Callable[P, int]:
    """``main`` returning its exit code, with a ``ValueError`` printed as one ``error:`` line (code 2)."""

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except ValueError as error:
            if is_main_rank():
                print_error(error)
            return EXIT_USER_ERROR
        return 0 if code is None else code

    return wrapper


def run_cli(main: Callable[[], int]) -> NoReturn:
    """The process entry point of a command: project notices as console lines (rank 0), known-harmless
    library warnings dropped (``megatron_lite.console``), then exit with ``main()``'s code."""
    show_notices()
    code = main()
    # The interpreter's final garbage collections walk every object torch, dynamo and DeepSpeed made (~1.2 s of
    # a CPU's time per process, in every rank); frozen, they are left to reference counting and the OS.
    gc.freeze()
    sys.exit(code)


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable ``name`` (``default`` when unset or empty)."""
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0  # reported below, with the same message as a non-positive value
    if not seconds > 0:
        raise ValueError(f"{name}={value!r}: expected a positive number of seconds")
    return seconds
