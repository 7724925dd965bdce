"""Session plumbing: the rank pools of tests/_dist.py live for the session (a pool whose workers
gathered too many threads is restarted between tests); the ``compat`` marker."""

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
