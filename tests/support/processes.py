"""Child processes of the multi-process tests: spawned, read line by line, always reaped.

Used by the shared-region, worker and process-kill tests, which all start real
Python processes, read JSON lines from them, kill some on purpose, and must
leave none behind whatever fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

__all__ = ["Children"]


class Children:
    """Python child processes of one test; :meth:`kill_all` reaps every one.

    Each child gets pipes for stdin, stdout and stderr (text); a test reads a
    child's JSON lines with :meth:`line`.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, script: str, *args: object) -> subprocess.Popen[str]:
        """Start ``python script args...``."""
        proc = subprocess.Popen(
            [sys.executable, script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
        """The next line ``proc`` prints, parsed as JSON (blocking).

        Raises
        ------
        AssertionError
            When the child closed its stdout first (its stderr is in the message).
        """
        assert proc.stdout is not None
        text = proc.stdout.readline()
        if not text:
            assert proc.stderr is not None
            raise AssertionError(f"the child said nothing; stderr:\n{proc.stderr.read()}")
        out: dict[str, Any] = json.loads(text)
        return out

    @staticmethod
    def tell(proc: subprocess.Popen[str], text: str) -> None:
        """Write one line to the child's stdin."""
        assert proc.stdin is not None
        proc.stdin.write(text + "\n")
        proc.stdin.flush()

    def kill_all(self) -> None:
        """Kill every child still running, wait for each, close its pipes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
