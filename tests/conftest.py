"""Session plumbing: the rank pools of tests/_dist.py live for the whole session."""

from tests._dist import shutdown_pools


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
