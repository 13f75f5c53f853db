"""What every `duoka` command sets in its environment before torch loads (and its workers inherit)."""

import os

from duoka.cli import main


def test_openmp_threads_sleep_at_barriers_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main([]) == 2  # no command: the help, then exit 2
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    main([])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
