"""The cores a process may use, and how data-parallel ranks share them: torch counts the
machine's cores, and threads beyond the usable ones spin at every barrier."""

import os

import pytest

from tandem.cpu_cores import usable_cores
from tandem.engine.service.ranks import rank_threads

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [
        ("max 100000\n", AFFINITY),  # no quota
        ("100000 100000\n", 1),  # a limit of 1 CPU
        ("250000 100000\n", min(AFFINITY, 3)),  # 2.5 CPUs: 3 cores' worth of threads
        ("1000 100000\n", 1),  # 10 m: never none
        ("garbage", AFFINITY),  # a file of another form: the affinity alone
    ],
)
def test_a_cpu_quota_caps_the_usable_cores(tmp_path, cpu_max, cores):
    quota = tmp_path / "cpu.max"
    quota.write_text(cpu_max)
    assert usable_cores(quota) == min(cores, AFFINITY)
    assert usable_cores(tmp_path / "absent") == AFFINITY  # no cgroup v2


def test_ranks_share_the_usable_cores_unless_told(monkeypatch):
    monkeypatch.setattr("tandem.engine.service.ranks.usable_cores", lambda: 8)
    assert rank_threads(None, 2, {}) == 4
    assert rank_threads(None, 3, {}) == 2
    assert rank_threads(None, 16, {}) == 1  # never none
    assert rank_threads(6, 2, {}) == 6  # --threads given
    assert rank_threads(None, 2, {"OMP_NUM_THREADS": "3"}) is None  # torch reads it
