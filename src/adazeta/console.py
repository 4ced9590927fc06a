"""The command's console: stdout that survives its reader (``adazeta-run ... | head -n 1``, ``> /dev/full``)."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any


class QuietStdout:
    """stdout that survives its reader: a closed pipe (``adazeta-run ... | head -n 1``) or a full device
    (``> /dev/full``) costs at most one line on stderr instead of a logging error per log line; the run goes on and
    writes its files as usual, and what it prints after that is dropped."""

    LOST = {errno.EPIPE: None, errno.ENOSPC: "no space left on the device it writes to"}

    def __init__(self, stream: Any):
        self._stream, self._lost = stream, False

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                return self._stream.write(text)
            except OSError as err:
                self._lose(err)
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except OSError as err:
                self._lose(err)

    def _lose(self, err: OSError) -> None:
        if err.errno not in self.LOST:
            raise err
        self._lost = True
        try:  # what the stream still buffers goes nowhere, at exit too
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        if self.LOST[err.errno]:
            print(f"adazeta-run: stdout: {self.LOST[err.errno]}; the console output is dropped from here, the run's "
                  "files are written as usual", file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
