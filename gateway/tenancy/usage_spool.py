"""Usage waiting for Redis, on local disk (torch-free): JSON lines appended to a file and flushed
to disk before the append returns, so what a gateway counted survives the process dying.

Each spool holds one file of the directory (`usage-<pid>-<random>.jsonl`) under an exclusive
lock (flock) while it lives; opening the directory takes over the files no live spool holds
(their gateway died): their lines move to the new file and are handed back to be written again
(each line is a request the usage script counts once, however often it is sent). A line torn by
the dying process is skipped (logged). The file is emptied once everything in it is written.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)
PATTERN = "usage-*.jsonl"


class Spool:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / f"usage-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._file: IO[str] = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the spool's life
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def adopt(self) -> list[dict[str, Any]]:
        """The lines of every file in the directory no live spool holds, moved into this one."""
        records: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob(PATTERN)):
            if path == self.path:
                continue
            try:
                with open(path, "r+", encoding="utf-8") as f:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # its gateway lives
                    if os.fstat(f.fileno()).st_nlink == 0:
                        continue  # another spool took it first
                    found = _lines(f.read(), path)
                    self.append(found)
                    path.unlink()
            except FileNotFoundError:
                continue  # another spool took it first
            records += found
        if records:
            log.warning("usage spool: %d request(s) left by a gateway that stopped, to be written", len(records))
        return records

    def append(self, records: list[dict[str, Any]]) -> None:
        """Written and on disk when this returns (OSError when not)."""
        if records:
            self._file.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
            self._file.flush()
            os.fsync(self._file.fileno())

    def clear(self) -> None:
        self._file.truncate(0)
        self._file.flush()
        os.fsync(self._file.fileno())

    def read(self) -> list[dict[str, Any]]:
        self._file.seek(0)
        return _lines(self._file.read(), self.path)

    def close(self) -> None:
        self._file.close()


def _lines(text: str, path: Path) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.error("usage spool %s: a torn line skipped (%d characters)", path, len(line))
    return records
