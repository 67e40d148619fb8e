"""Pseudo-gradient screening (the same decision on every peer) and the fault-injection spec."""

import math

import pytest
import torch

from composer_diloco import faults
from composer_diloco.faults import Fault, FaultPlan, parse_faults
from composer_diloco.outer.screening import pseudo_gradient_norm, screen


def peer(name, norm, weight=8.0):
    return {"name": name, "norm": norm, "weight": weight}


def test_norm_is_the_l2_norm_of_all_tensors_and_flags_non_finite():
    assert pseudo_gradient_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == pytest.approx(5.0)
    assert math.isnan(pseudo_gradient_norm([torch.tensor([1.0, float("nan")])]))
    assert math.isinf(pseudo_gradient_norm([torch.tensor([float("inf")])]))


def test_outlier_against_the_lower_median_even_in_a_group_of_two():
    verdicts = screen([peer("coordinator", 0.0, weight=0.0), peer("a", 1.0), peer("b", 50.0)], max_norm_ratio=10)
    assert verdicts[0] is None and verdicts[1] is None
    assert verdicts[2].name == "b" and "50 > 10 x the round's median 1" in verdicts[2].reason


def test_ordinary_spread_is_kept_and_non_finite_is_always_dropped():
    group = [peer("a", 1.0), peer("b", 3.0), peer("c", 9.0), peer("d", float("nan"))]
    verdicts = screen(group, max_norm_ratio=10)
    assert [v.name if v else None for v in verdicts] == [None, None, None, "d"]
    assert "non-finite" in verdicts[3].reason
    assert [v.name if v else None for v in screen([peer("a", 1.0), peer("b", 1e9)], None)] == [None, None]


def test_the_decision_does_not_depend_on_group_order():
    group = [peer("a", 2.0), peer("b", 100.0), peer("c", 3.0)]
    names = {v.name for v in screen(group, 10) if v}
    assert names == {v.name for v in screen(group[::-1], 10) if v} == {"b"}


def test_entries_without_a_norm_or_weight_are_never_dropped():
    assert screen([{"name": "old-peer"}, None, peer("z", float("inf"), weight=0.0)], 10) == [None, None, None]


def test_fault_spec_parses_and_names_bad_entries():
    assert parse_faults("kill_in_allreduce:1, step_delay:*:2.5, hold:*:/tmp/x") == (
        Fault("kill_in_allreduce", 1, None), Fault("step_delay", None, 2.5), Fault("hold", None, "/tmp/x"))
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        parse_faults("explode:1")
    with pytest.raises(ValueError, match="bad entry 'step_delay:x'"):
        parse_faults("step_delay:x")


def test_fault_points_are_no_ops_until_a_plan_is_installed():
    delta = [torch.ones(3)]
    try:
        faults.install(FaultPlan())
        faults.point("pseudo_gradient", 1, tensors=delta)
        assert torch.equal(delta[0], torch.ones(3))
        faults.install("scale_pseudo_gradient:1:10,nan_pseudo_gradient:2")  # as a test in-process arms it
        faults.point("pseudo_gradient", 0, tensors=delta)  # another round: untouched
        assert torch.equal(delta[0], torch.ones(3))
        faults.point("pseudo_gradient", 1, tensors=delta)
        assert torch.equal(delta[0], torch.full((3,), 10.0))
        faults.point("pseudo_gradient", 2, tensors=delta)
        assert math.isnan(delta[0][0].item())
        assert not faults.withholds_replies(1)
        assert faults.install_from_environment({faults.ENV_VAR: "kill_in_reply:3"}).armed("kill_in_reply", 3)
        assert faults.withholds_replies(3) and not faults.withholds_replies(4)
    finally:
        faults.install(FaultPlan())
