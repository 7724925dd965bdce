"""Session plumbing: the rank pools of tests/_dist.py live for the session (a pool whose workers
gathered too many threads is restarted between tests)."""

from tests._dist import retire_crowded_pools, shutdown_pools


def pytest_runtest_teardown(item, nextitem):
    retire_crowded_pools()


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
