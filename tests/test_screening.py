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


def test_a_member_that_trained_from_another_theta_is_dropped_and_told_whose_theta_the_group_holds():
    """The churn bench's seed 1 (BENCHMARKS 3e): after a settle, node-1 held another theta than the coordinator and
    node-0 and was averaged in anyway. The group's authority is its first member by step order that reports a theta
    (the coordinator, even at weight 0; else the lowest name); an empty theta (a peer just joined) is not compared."""
    def member(name, theta, norm=1.0, weight=8.0):
        return {"name": name, "role": "coordinator" if name == "coordinator" else "node", "norm": norm,
                "weight": weight, "theta": theta}

    group = [member("node-1", "f0591348ee00"), member("coordinator", "80e3dabb7c70", 0.0, weight=0.0),
             member("node-0", "80e3dabb7c70")]
    verdicts = screen(group, max_norm_ratio=10)
    assert verdicts[0] is not None and verdicts[0].theta_authority == "coordinator" and verdicts[1:] == [None, None]
    assert verdicts[0].reason == "trained from theta f0591348ee00, but the group's authority coordinator holds " \
                                 "80e3dabb7c70"
    assert screen(group[::-1], 10)[2] == verdicts[0]  # the same decision in any order
    without = [member("node-2", "aa"), member("node-0", "bb"), member("node-1", "")]  # no coordinator: node-0 rules
    assert [v.theta_authority if v else None for v in screen(without, 10)] == ["node-0", None, None]
    assert screen([member("node-0", "aa"), member("node-1", "aa")], 10) == [None, None]
    # a dropped theta does not count toward the median the norm rule compares with
    odd = [member("coordinator", "aa", weight=0.0), member("node-0", "aa", 1.0), member("node-1", "bb", 1e6),
           member("node-2", "aa", 2.0)]
    assert [v.name if v else None for v in screen(odd, 10)] == [None, None, "node-1", None]


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
