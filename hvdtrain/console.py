"""Console output under launchers."""

from __future__ import annotations

import io
import sys


def whole_lines() -> None:
    """Each printed line leaves in one write. horovodrun sets PYTHONUNBUFFERED=1, so `print` sends
    the text and its newline in two writes, and Open MPI, which tags each write with its rank, then
    glues the next tag to the end of the line ("... accuracy 0.9274[1,0]<stdout>:"). Line buffering
    flushes once, at the newline."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:
            stream.reconfigure(line_buffering=True, write_through=False)
