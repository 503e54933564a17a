"""The autoscaling study (bench/sim_study.py autoscale) on a short stretch of its day."""

from tandem.sim import study_autoscale
from tandem.sim.summary import summarize


def test_the_study_prints_its_ratios_against_the_fixed_baseline():
    # docs/benchmarks.md quotes them: they were worked out by hand from the table.
    requests = study_autoscale.trace(3.0, 0, 300.0)
    runs = study_autoscale.run_study(requests, until_s=300.0, log=lambda _: None)
    (auto_name, auto), (fixed_name, fixed) = (
        (name, summarize(run, study_autoscale.SLO_DAY)) for name, run in runs.items()
    )
    assert fixed_name.startswith("fixed") and fixed.gpu_seconds > auto.gpu_seconds > 0
    fewer = fixed.gpu_seconds / auto.gpu_seconds
    better = auto.goodput_per_gpu_hour / fixed.goodput_per_gpu_hour
    last = study_autoscale.summary_line(runs).splitlines()[-1]
    assert last == (
        f"{auto_name} against {fixed_name}: {fewer:.1f}x fewer GPU-hours, "
        f"{better:.1f}x the good requests per GPU-hour"
    )
