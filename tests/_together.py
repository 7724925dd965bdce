"""Launches of several tests started together, for module-scoped fixtures.

A test that launches ``torchrun`` or a fresh interpreter spends much of its time with one core
busy and the other idle (an interpreter importing torch, torchrun waiting for its ranks). Where
a module has several such tests, each checking its own independent launch, a module fixture
starts them all at once, each in a thread and a directory of its own, and each test waits for
its own result: the launches and the assertions are the tests' own, only the waiting overlaps.
"""

from __future__ import annotations

import contextlib
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import pytest

__all__ = ["launched_together", "run_together", "started_together"]

T = TypeVar("T")


@contextlib.contextmanager
def started_together(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                     launches: dict[str, Callable[[Path], T]]) -> Iterator[dict[str, Future[tuple[Path, T]]]]:
    """``launches[name](directory)`` for each test ``name`` of the fixture's module that this
    session runs, started together; yields ``name`` -> the future of ``(directory, its result)``
    (``result()`` raises what the launch raised). Leaving waits for every launch to end."""
    selected = {item.originalname for item in request.session.items if item.path == request.path}
    wanted = [name for name in launches if name in selected]

    def launch(name: str) -> tuple[Path, T]:
        root = tmp_path_factory.mktemp(name.removeprefix("test_")[:30])
        return root, launches[name](root)

    with ThreadPoolExecutor(max(1, len(wanted))) as pool:
        yield {name: pool.submit(launch, name) for name in wanted}


def launched_together(launches: dict[str, Callable[[Path], T]]) -> Any:
    """A module-scoped fixture of :func:`started_together` over ``launches`` (test name ->
    ``launch(directory)``): test -> the future of (its directory, the launch's result)."""

    @pytest.fixture(scope="module")
    def fixture(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[tuple[Path, T]]]]:
        with started_together(request, tmp_path_factory, launches) as futures:
            yield futures

    return fixture


def run_together(commands: dict[str, list[str]], *, timeout: float,
                 **popen: Any) -> dict[str, subprocess.CompletedProcess]:
    """Each of ``commands`` (name -> argv) started at once, its output captured as text
    (``popen``: more of ``subprocess.Popen``'s arguments); name -> the finished process. Each
    one's ``timeout`` counts from when the previous one ended; one past it raises
    ``subprocess.TimeoutExpired``, and those still running are killed."""
    procs = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
             for name, argv in commands.items()}
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done
