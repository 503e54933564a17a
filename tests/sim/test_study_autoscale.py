"""The autoscaling study (bench/sim_study.py autoscale) on a short stretch of its day."""

from tandem.sim import study_autoscale, workload
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


def test_a_shorter_study_draws_its_share_of_the_days_bursts(monkeypatch):
    # Prorated twice (12 x (d / day)^2): 12 hours drew 3.4 bursts on average, not 6.
    drawn = []
    real = workload.rate_at

    def spy(t, mean_rate, swing, period_s, starts, lengths, factors):
        drawn.append(len(starts))
        return real(t, mean_rate, swing, period_s, starts, lengths, factors)

    monkeypatch.setattr(workload, "rate_at", spy)
    for seed in range(20):
        study_autoscale.trace(0.01, seed, study_autoscale.DAY_S / 2)
    assert 4.5 < sum(drawn) / len(drawn) < 7.5  # 6 expected
