"""layerwise/reproduce/pipefisher.py: the paper-scale arithmetic against hand-computed cases, and the
verdict logic on tiny inputs (the experiments themselves run from train.py, not here)."""

import pytest

from cost.inputs import Device, GptShape, Workload
from parallel.dims import Layout
from cost.kfac import kfac_cost, preconditioning_flops
from layerwise.reproduce import pipefisher as pf
from strategies.schedule import FORWARD, Action, add_communication, add_gradient_reductions, build_plan
from strategies.schedule import curvature as units


def test_closed_form_bubble_is_the_papers_for_one_loop_and_shrinks_with_loops():
    assert pf.closed_form_bubble(8, 8) == pytest.approx(7 / 15)  # (D − 1) / (2D − 1), D = 8: 46.7%
    assert pf.closed_form_bubble(4, 4, micro_batches=4) == pytest.approx(3 / 7)  # 42.9%
    assert pf.closed_form_bubble(8, 16) == pytest.approx(7 / 23)  # looped, v = 2


def test_preconditioning_flops_by_hand():
    # h = 2, mlp ratio 1: qkv (2 → 6), proj, fc_in, fc_out (2 → 2); 2·out²·in + 2·out·in² each
    shape = units.BlockShape(hidden=2, mlp_ratio=1, sequence_length=4, tokens=8, layers_per_stage=3)
    per_block = (2 * 36 * 2 + 2 * 6 * 4) + 3 * (2 * 4 * 2 + 2 * 2 * 4)
    assert preconditioning_flops(shape) == 3 * per_block


def tiny_workload():
    layout = Layout(data=1, pipeline=2)
    return Workload(GptShape(hidden=128, mlp_ratio=4, vocabulary=257, length=128, max_length=256),
                    layers=2, heads=4, layout=layout, layers_per_stage=1, micro_batch_rows=4)


def tiny_plan():
    return add_gradient_reductions(add_communication(build_plan("gpipe", pipeline_degree=2, stages=2,
                                                                micro_batches=4)))


def test_kfac_units_cost_their_flops_at_the_forwards_rate():
    device = Device(1e12, 0.5, 1e10, 1e11, 1e10, 8)
    cost = kfac_cost(tiny_workload(), device, tiny_plan())
    h, s = 128, 128
    # curvature A of qkv: 2·T·h²; forward of stage 0 (no head): T·(2·(4 + 2·4)·h² + 4·s·h)
    expected = 2 * h * h / (2 * 12 * h * h + 4 * s * h)
    assert cost(Action(units.CURVATURE["A", "q"], 0, 0)) / cost(Action(FORWARD, 0, 0)) == pytest.approx(expected)


def test_training_time_is_steps_ratio_times_step_ratio():
    row = {"model": "m", "schedule": "gpipe", "step_first_order_s": 1.0, "step_pipefisher_s": 1.1,
           "step_kfac_no_bubbles_s": 1.5}
    report = {"steps_ratio": 0.5, "steps_ratio_range": [0.4, 0.6]}
    time = pf.training_time(row, report)
    assert (time["time_ratio"], time["time_ratio_low"], time["time_ratio_high"]) == pytest.approx((0.55, 0.44, 0.66))
    assert time["time_ratio_kfac_no_bubbles"] == pytest.approx(0.75)


@pytest.mark.parametrize("low, high, verdict", [(0.52, 0.7, "reproduced"), (0.6, 0.9, "partly"),
                                                (0.8, 1.1, "refuted"), (0.3, 0.4, "partly")])
def test_time_verdict(low, high, verdict):
    assert pf.verdict_time(low, high) == verdict


def test_ratio_verdict():
    assert pf.verdict_ratio([1.5, 1.7], [2]) == "reproduced"
    assert pf.verdict_ratio([1.1, 1.4], [2, 3]) == "partly"
    assert pf.verdict_ratio([0.8], [1]) == "refuted"


def test_missing_report_names_the_command(tmp_path):
    class Reproduce:
        convergence_report = str(tmp_path / "absent.json")

    class Config:
        reproduce = Reproduce()

    with pytest.raises(FileNotFoundError, match="pipefisher_convergence.py"):
        pf.read_report(Config())


def report(steps_ratio=0.6):
    method = {"best_point": {"optimizer": "lamb"}, "learning_rates_tried": ["1e-2"], "final_val_loss_by_seed": [2.0],
              "steps_to_target_by_seed": [30], "steps_to_target_mean": 30.0}
    return {"model": "bert_tiny", "budget_steps": 50, "refresh_interval": 2, "target_val_loss": 2.5,
            "steps_ratio": steps_ratio, "steps_ratio_range": [steps_ratio, steps_ratio], "kfac": method,
            "first_order": method}


def test_small_scale_comparison_on_tiny_inputs():
    predicted = {"first_order": 0.2, "pipefisher": 0.05, "k": 1, "ratio": 0.7, "step_overhead": 0.01}
    summaries = {"gpipe": {"status": "completed", "bubble_fraction": {"simulated": 0.2, "measured": 0.35},
                           "step_time_s_median": 1.0},
                 "pipefisher": {"status": "completed", "step_time_s_median": 1.04,
                                "bubble_fraction": {"simulated_with_kfac": 0.05, "measured": 0.3}}}
    rows = pf.bubble_rows(predicted, summaries)
    assert [r["measured"] for r in rows] == [0.35, 0.3] and rows[1]["simulated_in_run"] == 0.05
    verdicts = pf.small_verdicts(rows, report(), predicted)
    assert [v.verdict for v in verdicts] == ["reproduced", "reproduced", "reproduced"]
    assert "+4.0%" in verdicts[1].measurement
    summaries["pipefisher"]["bubble_fraction"]["measured"] = 0.4  # K-FAC made the idle time grow
    assert pf.small_verdicts(pf.bubble_rows(predicted, summaries), report(1.2), predicted)[0].verdict == "refuted"
    spread = report(0.8) | {"steps_ratio_range": [0.5, 1.2]}  # the means say fewer steps, not every seed
    assert pf.small_verdicts(rows, spread, predicted)[2].verdict == "partly"
    summaries["pipefisher"]["step_time_s_median"] = 1.3  # K-FAC on the critical path after all
    assert pf.small_verdicts(pf.bubble_rows(predicted, summaries), report(), predicted)[1].verdict == "partly"
    summaries["gpipe"] = {"status": "failed"}
    verdicts = pf.small_verdicts(pf.bubble_rows(predicted, summaries), report(1.2), predicted)
    assert [v.verdict for v in verdicts] == ["not tested", "not tested", "refuted"]


def test_paper_verdicts_on_hand_rows():
    def row(schedule, ratio, k):
        return {"schedule": schedule, "kfac_work_per_bubble": ratio, "k_needed": k, "bubble_plan": 0.47,
                "bubble_with_kfac": 0.12, "step_first_order_s": 1.0, "step_pipefisher_s": 1.02}
    rows = [row("gpipe", 1.5, 2), row("one_f_one_b", 1.6, 2), row("looped_breadth_first", 3.0, 4)]
    times = [{"model": "bert_base", "schedule": r["schedule"], "time_ratio": t, "time_ratio_kfac_no_bubbles": 0.9}
             for r, t in zip(rows, (0.6, 0.62, 0.5))]
    verdicts = pf.paper_verdicts(rows, times, report())
    assert [v.verdict for v in verdicts] == ["reproduced", "reproduced", "reproduced", "not tested"]
    assert "60%–62%" in verdicts[2].prediction and "+2.0%" in verdicts[1].prediction
    rows[0]["step_pipefisher_s"] = 1.2  # a fifth of the step on the critical path: not "about a step"
    assert pf.paper_verdicts(rows, times, report())[1].verdict == "partly"
