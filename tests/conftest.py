"""Session plumbing: the rank pools of tests/_dist.py live for the session (a pool whose workers
gathered too many threads is restarted between tests); the ``compat`` marker; the summary of
durations by directory that ends every run (docs/testing.md quotes CI's)."""

from collections import defaultdict

import pytest

from tests._dist import retire_crowded_pools, shutdown_pools

# CI runs the whole suite on torch 2.13 and, on the ends of pyproject's range (2.11, 2.14), the
# quick tests of these (``-m "compat and not slow"``, docs/testing.md): the ones that reach what
# differs between releases (fsdp2/_compat.py: DTensor's internals, the flat collectives,
# pipelining, DCP, compile, the planner's fake process group, the documented commands' version
# checks) and compare with torch's own fully_shard of that release. A directory covers its files.
COMPAT = (
    "tests/unit/",
    "tests/parallel/",
    "tests/runtime/test_parity.py",
    "tests/runtime/test_state_dict.py",
    "tests/runtime/test_serialization.py",
    "tests/runtime/test_compile.py",
    "tests/runtime/test_mixed_precision.py",
    "tests/comm/test_comm_debug_mode.py",
    "tests/comm/test_comms.py",
    "tests/tools/test_checkpoint.py",
    "tests/tools/test_checkpoint_async.py",
    "tests/tools/test_doc_commands.py",
    "tests/tools/test_plan_meta.py",
    "tests/tools/test_plan_then_train.py",
    "tests/tools/test_recipe_pipeline.py",
    "tests/integration/test_torchtitan.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(COMPAT):
            item.add_marker(pytest.mark.compat)


def pytest_runtest_teardown(item, nextitem):
    retire_crowded_pools()


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()


# tests/<folder>/ -> [seconds in setup, call and teardown, tests run]
_BY_FOLDER: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def pytest_runtest_logreport(report):
    folder = "/".join(report.nodeid.split("::")[0].split("/")[:2]) + "/"
    _BY_FOLDER[folder][0] += report.duration
    _BY_FOLDER[folder][1] += report.when == "call"


def pytest_terminal_summary(terminalreporter):
    if not _BY_FOLDER:
        return
    terminalreporter.section("durations by directory")
    for folder, (seconds, count) in sorted(_BY_FOLDER.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{seconds:8.1f} s {count:6d} tests  {folder}")
    total = sum(seconds for seconds, _ in _BY_FOLDER.values())
    terminalreporter.write_line(f"{total:8.1f} s {sum(n for _, n in _BY_FOLDER.values()):6d} tests  in all")
