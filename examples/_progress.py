"""Progress where people wait: a tqdm bar on a terminal, the examples' plain lines elsewhere.

Every example with a training loop wraps it in :func:`progress` and prints its lines with
:func:`say`:

* stdout is a terminal and tqdm is installed (``pip install -e ".[examples]"``): the loop
  shows a bar (items done, rate, time left), and :func:`say`'s lines go above it;
* otherwise (a pipe, a file, the test suite, which parses ``RESULT`` lines; or no tqdm):
  the loop runs over the items as they are, no bar, and the example's own occasional
  lines (every 10 episodes, every epoch...) are the progress, printed plainly.

The workers of one job share the terminal, so one bar is shown per job: the process
the user waits on passes ``show=True`` (the agent, the master, the first trainer;
trainers that step together are as far along as it is), the others ``show=False``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
CLEAR_LINE = "\r\x1b[K"  # back to the start of the line and erase it: where a bar is drawn


def on_terminal() -> bool:
    """Whether stdout is a terminal (a person watching) rather than a pipe or a file."""
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, show: bool = True
) -> Iterator[T]:
    """``items``, one by one; on a terminal (with tqdm, and ``show``) drawn as a bar."""
    if show and on_terminal():
        try:
            from tqdm import tqdm
        except ImportError:  # the examples' extra is not installed: plain lines only
            pass
        else:
            return iter(tqdm(items, desc=desc, total=total, file=sys.stdout, dynamic_ncols=True))
    return iter(items)


def say(line: str) -> None:
    """Print ``line`` in one write (lines of processes sharing stdout never mix).

    On a terminal it first erases the current line, which holds the bar if one is
    drawn (by this process or another of the job): the line takes the bar's place and
    the bar is redrawn below it at its next update."""
    prefix = CLEAR_LINE if on_terminal() else ""
    sys.stdout.write(f"{prefix}{line}\n")
    sys.stdout.flush()
