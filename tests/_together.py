"""Launches of several tests started together, for module-scoped fixtures.

A test that launches ``torchrun`` or a fresh interpreter spends much of its time with one core
busy and the other idle (an interpreter importing torch, torchrun waiting for its ranks). Where
a module has several such tests, each checking its own independent launch, a module fixture
starts them all at once, each in a thread and a directory of its own, and each test waits for
its own result: the launches and the assertions are the tests' own, only the waiting overlaps.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

__all__ = ["started_together"]

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
