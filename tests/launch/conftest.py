"""Session fixtures: a real Slurm and a real sshd on this machine (tests/launch/real_cluster.py).

Started once per pytest process, and only by the tests that ask for them (each lives in one
test file, so that pytest-xdist's `--dist loadfile` runs it once per CI run); skipped with
the reason where the packages cannot be installed (not root, no apt-get).
"""

import pytest

from tests.launch import real_cluster


def _daemon(packages, make):
    reason = real_cluster.install(packages)
    if reason:
        pytest.skip(reason)
    daemon = make()
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def real_slurm():
    """munged, slurmctld and two slurmd nodes (`real_cluster.SlurmCluster`)."""
    yield from _daemon(real_cluster.SLURM_PACKAGES, real_cluster.SlurmCluster)


@pytest.fixture(scope="session")
def real_sshd():
    """sshd on 127.0.0.1 and 127.0.0.2 with a throwaway key (`real_cluster.Sshd`)."""
    yield from _daemon(real_cluster.SSH_PACKAGES, real_cluster.Sshd)
