"""bench/sim_study.py refuses the flags a study does not use: `disagg --rate 2` ran its
own sweep of rates and said nothing of the 2."""

from __future__ import annotations

import pytest

from tests.bench.conftest import run_bench


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["disagg", "--rate", "2"], "--rate: the disagg study sweeps its own rates"),
        (["intervals", "--scale-up-windows", "5"], "only the autoscale study takes it"),
        (["disagg", "--scale-up-windows", "5"], "only the autoscale study takes it"),
    ],
)
def test_a_flag_the_study_does_not_use_is_refused(args, says):
    run = run_bench("sim_study.py", *args)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
