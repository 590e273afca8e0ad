"""mode=calibrate (layerwise/tools/calibrate.py): the fit recovers what it is given, and the written
profile is the fit of the recorded measurements and composes as a `hardware=` option."""

import json

import pytest

from layerwise.tools.calibrate import (BEHIND_PRODUCTS, STABLE, calibrate, fit_fixed_plus_rate, hidden_share,
                                      mean_until_stable, median_seconds, relative_error, worst_residual)
from layerwise.preflight import validate
from tests.ranks import compose_config


def test_fit_recovers_a_fixed_cost_and_a_rate():
    work = [1e3, 1e5, 1e7]
    seconds = [2e-5 + w / 4e9 for w in work]
    fixed, rate = fit_fixed_plus_rate(work, seconds)
    assert fixed == pytest.approx(2e-5, rel=1e-9) and rate == pytest.approx(4e9, rel=1e-9)
    assert worst_residual(work, seconds, fixed, rate) < 1e-9
    # noise that would make the fixed cost negative: clamped to 0, the rate refitted through the
    # origin with the same 1/t² weights: rate = Σw·x² / Σw·x·t
    fixed, rate = fit_fixed_plus_rate([1.0, 2.0], [0.9, 2.0])
    weights = [1 / 0.81, 1 / 4.0]
    assert fixed == 0.0 and rate == pytest.approx((weights[0] + 4 * weights[1]) / (0.9 * weights[0] + 4 * weights[1]))


def test_a_sample_repeats_short_work_until_it_lasts_the_sample_time():
    """Local work is timed in samples of at least `sample_s` (one call of a small product is within
    the timer's and the scheduler's noise); the result is still seconds per call. The clock is one
    only the work advances (1 ms a call), so the counts are exact whatever else the machine runs
    (issue 55: a busy loop against the wall clock failed under load, 3.1 ms for 1 ms of work)."""
    now, calls = [0.0], []

    def work() -> None:
        calls.append(1)
        now[0] += 1e-3
    per_call = median_seconds(work, 3, sample_s=0.02, clock=lambda: now[0])
    assert per_call == pytest.approx(1e-3)
    assert len(calls) == 2 + 3 * 20  # warm-up, sizing call, then 3 samples of 0.02 s / 1 ms calls
    calls.clear()
    median_seconds(work, 3, clock=lambda: now[0])  # sample_s 0 (collectives: every rank must make the same calls): one call each
    assert len(calls) == 4


def test_relative_error_is_the_batch_means_standard_error_over_their_mean():
    # batch means 1, 2, 3: sd 1, standard error 1/√3, mean 2; the worst of the components is kept
    assert relative_error([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]]) == pytest.approx(1 / 3 ** 0.5 / 2)
    assert relative_error([[1.0]]) == float("inf")


def test_sampling_stops_when_the_mean_is_stable_and_not_before():
    """A steady value stops at `min_batches`; a value whose batch means keep their spread runs to
    `max_batches`; a spread that settles stops once the standard error reaches STABLE."""
    steady = mean_until_stable(lambda: [2.0], batch=3, min_batches=4, max_batches=50, budget_s=60)
    assert steady == {"mean": [2.0], "relative_error": 0.0, "samples": 12}
    values = iter([1.0, 3.0] * 100)  # batch means 1, 3, 1, 3, ...: ±50% per batch
    noisy = mean_until_stable(lambda: [next(values)], batch=1, min_batches=3, max_batches=8, budget_s=60)
    assert noisy["samples"] == 8 and noisy["mean"] == [2.0] and noisy["relative_error"] > STABLE
    # the error falls as 1/√batches: 1, 3 alternating then only 2s, stopping where it first is ≤ STABLE
    settling = iter([1.0, 3.0] + [2.0] * 1000)
    settled = mean_until_stable(lambda: [next(settling)], batch=1, min_batches=2, max_batches=1000, budget_s=60)
    n = settled["samples"]
    assert relative_error([[1.0], [3.0]] + [[2.0]] * (n - 2)) <= STABLE < relative_error([[1.0], [3.0]] + [[2.0]] * (n - 3))
    # every rank of a collective takes rank 0's decision: `agree` overrides this rank's own
    decisions = iter([False, False, True])
    agreed = mean_until_stable(lambda: [2.0], batch=1, min_batches=1, max_batches=50, budget_s=60,
                               agree=lambda done: next(decisions))
    assert agreed["samples"] == 3


def test_the_hidden_share_of_a_posted_gather_is_what_compute_behind_it_removed():
    """Per row (gather − exposed) ÷ min(compute behind, gather), clamped to [0, 1], then the mean:
    cost.step_time.exposed_gather prices a gather with that share."""
    rows = [(1, 1.5e-3, 3.0e-3, 2.1e-3, 0.02, 30),  # 0.9 of 3 ms hidden behind 1.5 ms: 0.6
            (4, 6.0e-3, 3.0e-3, 0.6e-3, 0.02, 30),  # 2.4 of 3 ms hidden, more compute than gather: 0.8
            (2, 3.0e-3, 2.0e-3, 2.5e-3, 0.02, 30)]  # slower than alone (noise): 0, not negative
    assert hidden_share(rows) == pytest.approx((0.6 + 0.8 + 0.0) / 3)
    assert hidden_share([(1, 1e-3, 2e-3, 0.0, 0.0, 10)]) == 1.0  # all hidden behind 1 ms: clamped to 1


def test_quick_calibration_writes_a_profile_that_composes(tmp_path):
    directory = tmp_path / "hardware"
    cfg = compose_config("mode=calibrate", "calibrate.quick=true", "calibrate.silent=true",
                         "calibrate.repeats=3", f"calibrate.directory={directory}", "calibrate.name=probe_profile")
    profile = calibrate(cfg)  # a name of its own: this checkout may hold a calibrated.yaml of its machine
    measured = json.loads((directory / "probe_profile.calibration.json").read_text())
    # the profile is the fit of the recorded rows, nothing else
    rows = measured["matmul_fp32"]["rows"]
    overhead, flops = fit_fixed_plus_rate([r[1] for r in rows], [r[2] for r in rows])
    assert profile["peak_flops"]["fp32"] == pytest.approx(flops) and profile["matmul_overhead_s"] == pytest.approx(overhead)
    reduce_rows = measured["collectives_world_2"]["rows"]
    latency, bandwidth = fit_fixed_plus_rate([r[0] for r in reduce_rows], [r[1] for r in reduce_rows])
    assert profile["intra_node_bandwidth"] == pytest.approx(bandwidth)  # 2(n-1)/n = 1 at n = 2
    assert profile["collective_latency_s"] == pytest.approx(latency)
    assert all(r[1] > 0 and r[2] > 0 for r in reduce_rows)  # both all-reduce and round trip were timed
    # each size sampled in batches of 20 until stable (at least max(3, repeats) batches), its error kept
    assert all(r[4] >= 60 and r[4] % 20 == 0 and r[3] > 0 for r in reduce_rows)
    one_way = fit_fixed_plus_rate([r[0] for r in reduce_rows], [r[2] / 2 for r in reduce_rows])[0]
    assert profile["point_to_point_latency_s"] == pytest.approx(max(one_way, 1e-6))
    overlap = measured["gather_overlap"]  # a posted 1 MB gather behind 1, 2, 4 products, each timed
    assert [r[0] for r in overlap["rows"]] == list(BEHIND_PRODUCTS)
    assert all(alone > 0 and gather > 0 and exposed >= 0 and samples >= 10 and samples % 10 == 0
               for _, alone, gather, exposed, _, samples in overlap["rows"])
    assert profile["gather_overlap"] == overlap["hidden_share"] == pytest.approx(hidden_share(overlap["rows"]))
    assert 0 <= profile["gather_overlap"] <= 1
    blocks = measured["blocks"]["rows"]  # (elements, seconds of non-product work per block forward)
    fixed, rate = fit_fixed_plus_rate([r[0] for r in blocks], [r[1] for r in blocks])
    assert profile["block_overhead_s"] == pytest.approx(fixed)
    assert profile["activation_seconds_per_element"] == pytest.approx(1 / rate) and rate > 0
    assert measured["blocks"]["rounds"] >= 2 and measured["framework"]["runs"] >= 2  # rounds until stable
    steps = measured["optimizer"]["rows"]  # (parameters, seconds of one optimizer step)
    assert profile["optimizer_seconds_per_parameter"] == pytest.approx(1 / fit_fixed_plus_rate(
        [r[0] for r in steps], [r[1] for r in steps])[1])
    # the collective table is the all-reduce rows against the bytes a rank sends (2(n-1)/n = 1 at n = 2)
    assert profile["collective_seconds_by_bytes"] == [[r[0], r[1]] for r in sorted(reduce_rows)]
    # the framework's costs solve the two tiny runs: unpriced = step cost + actions × action cost
    (single, single_priced, single_actions), (pipeline, pipeline_priced, pipeline_actions) = measured["framework"]["rows"]
    step, action = profile["step_overhead_s"], profile["action_overhead_s"]
    assert pipeline_actions > single_actions > 0 and step >= 0 and action >= 0
    if step > 0 and action > 0:  # neither clamped
        assert single_priced + step + action * single_actions == pytest.approx(single)
        assert pipeline_priced + step + action * pipeline_actions == pytest.approx(pipeline)
    composed = compose_config("hardware=probe_profile", f"hydra.searchpath=[file://{tmp_path}]")
    assert composed.hardware.peak_flops.fp32 == pytest.approx(flops)
    assert composed.hardware.host_device_bandwidth == pytest.approx(profile["host_device_bandwidth"])
    assert composed.hardware.gather_overlap == pytest.approx(profile["gather_overlap"])
    assert validate(composed) == 2  # a valid profile: the default experiment runs on it
