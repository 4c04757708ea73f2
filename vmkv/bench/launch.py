"""``bench serve --launch``: run ``vmkv serve`` as a child process on a free 127.0.0.1 port.

The server's output goes to a temporary log file (its tail goes into error messages); ``/health`` is
polled until it answers 200. Leaving the context sends SIGINT (uvicorn's graceful shutdown),
then SIGKILL if the child has not exited after ``stop_timeout`` seconds.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """A ``vmkv serve`` child; ``with LaunchedServer([...]) as srv: srv.base_url``."""

    def __init__(self, serve_args: Sequence[str], *, start_timeout: float = 300.0,
                 stop_timeout: float = 20.0, cwd: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "vmkv.cli", "serve", *serve_args,
                     "--host", "127.0.0.1", "--port", str(self.port)]
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.cwd = cwd  # another checkout's vmkv is imported when run from its root
        self.startup_s: float | None = None
        # closed (and removed) by stop(); read back for error messages
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="vmkv-serve-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LaunchedServer:
        import httpx

        started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.cwd)
        while time.monotonic() - started < self.start_timeout:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"vmkv serve exited with {self.proc.returncode} before "
                                   f"becoming healthy:\n{tail}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"vmkv serve was not healthy after {self.start_timeout:.0f} s:\n"
                           f"{tail}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the child (SIGINT, then SIGKILL); close and remove the log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
