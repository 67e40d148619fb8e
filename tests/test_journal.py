"""The inner phase's journal (`composer_diloco.inner.journal`): what a node's next life takes over from the phase its
last life was cut in. Real tensors, a real AdamW and real files; the run that resumes one is in tests/test_standby.py."""

import torch
from torch import nn

from composer_diloco.inner.journal import JOURNAL_FILE, PhaseJournal, Resumed, journal_bytes


def _policy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    model[1].bias.requires_grad_(False)  # a frozen tensor (a LoRA base weight): not journaled
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 6), float(i + 1))).square().sum().backward()
        optimizer.step()


def _cut_phase(tmp_path, round_=5, steps=3) -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    """A life that trained ``steps`` inner steps of round ``round_``'s phase and journaled them."""
    model = _policy(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    journal = PhaseJournal(tmp_path, "digest-a", 1 << 20, model)
    journal.begin_phase(model)
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, steps)
    journal.record_step(model, optimizer, round_, steps, samples=8 * steps, seconds=1.5 * steps)
    journal.flush()  # written by its own thread
    return model, start, optimizer


def test_the_next_life_goes_on_from_the_cut_phase_on_its_newer_theta(tmp_path):
    """x <- theta_R + (x - x0) for the trainable tensors only, AdamW's moments and steps as they were, and the
    journal's round, steps, episodes and seconds for the phase's line and weight."""
    cut, start, cut_optimizer = _cut_phase(tmp_path)
    theta = _policy(1)  # the newer theta the next life downloaded
    expected = [t.detach() + (c.detach() - s) if t.requires_grad else t.detach().clone()
                for t, c, s in zip(theta.parameters(), cut.parameters(), start)]
    optimizer = torch.optim.AdamW([p for p in theta.parameters() if p.requires_grad], lr=0.01)
    journal = PhaseJournal(tmp_path, "digest-a", 1 << 20, theta)
    journal.begin_phase(theta)
    x0 = [p.detach().clone() for p in theta.parameters()]  # theta_R: where this life's phase starts
    resumed = journal.resume(theta, optimizer, round_=6)
    assert resumed == Resumed(round=5, steps=3, samples=24, seconds=4.5)
    assert resumed.record() == {"resumed_round": 5, "resumed_steps": 3, "resumed_samples": 24,
                                "resumed_inner_seconds": 4.5}
    for got, want in zip(theta.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    mine, theirs = optimizer.state_dict()["state"], cut_optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys() and len(mine) == 3
    for k in mine:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[k][name], theirs[k][name], rtol=0, atol=0)
    # this life is cut too, one step later: its journal holds the whole phase's progress from theta_R, the cut
    # phase's and its own step, with the steps, episodes and seconds of both lives
    _train(theta, optimizer, 1)
    journal.record_step(theta, optimizer, 6, 4, samples=32, seconds=6.0)
    journal.flush()
    third = _policy(2)
    before = [p.detach().clone() for p in third.parameters()]
    journal3 = PhaseJournal(tmp_path, "digest-a", 1 << 20, third)
    assert journal3.resume(third, torch.optim.AdamW([p for p in third.parameters() if p.requires_grad]), 7) == \
        Resumed(6, 4, 32, 6.0)
    for got, b, now, start in zip(third.parameters(), before, theta.parameters(), x0):
        want = b + (now.detach() - start) if got.requires_grad else b
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)


def test_a_journal_that_does_not_fit_the_new_life_is_set_aside(tmp_path):
    """Another run config, another layout, a round too far behind (or ahead of) the one joined: not resumed, and the
    life's weights and optimizer are left as they were."""
    _cut_phase(tmp_path, round_=5)
    cases = [("digest-b", _policy(1), 6), ("digest-a", nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3)), 6),
             ("digest-a", _policy(1), 8), ("digest-a", _policy(1), 4)]
    for digest, model, round_ in cases:
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters())
        journal = PhaseJournal(tmp_path, digest, 1 << 20, model, max_stale_rounds=2)
        journal.begin_phase(model)
        assert journal.resume(model, optimizer, round_) is None, (digest, round_)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert optimizer.state_dict()["state"] == {}
    assert PhaseJournal(tmp_path, "digest-a", 1 << 20, _policy(1), max_stale_rounds=3).resume(
        _policy(1), torch.optim.AdamW([p for p in _policy(1).parameters() if p.requires_grad]), 8) is not None


def test_a_phase_that_ended_is_never_resumed_and_a_journal_too_large_is_off(tmp_path):
    """`end_phase` (at the phase's end, before its hand-off) and `discard` remove the journal: nothing is counted
    twice. A model whose entry is over ``journal_max_bytes`` (or with it at 0) writes none."""
    model, _, optimizer = _cut_phase(tmp_path)
    journal = PhaseJournal(tmp_path, "digest-a", 1 << 20, model)
    assert (tmp_path / JOURNAL_FILE).exists()
    journal.end_phase()
    assert not (tmp_path / JOURNAL_FILE).exists()
    _cut_phase(tmp_path)
    journal.discard()
    journal.discard()  # idempotent
    assert not (tmp_path / JOURNAL_FILE).exists()
    assert journal.resume(model, optimizer, 5) is None
    for _ in range(20):  # an entry its thread has not written yet, or is writing, when the phase ends: never kept
        journal.begin_phase(model)
        journal.record_step(model, optimizer, 6, 1, samples=8, seconds=1.0)
        journal.discard()
        journal.flush()
        assert not (tmp_path / JOURNAL_FILE).exists()
    assert not list(tmp_path.glob(".inner_phase.pt.tmp-*"))
    need = journal_bytes(model)
    assert need == 16 * (6 * 5 + 5 + 5 * 3)  # the frozen bias is not counted
    for max_bytes in (need - 1, 0):
        small = PhaseJournal(tmp_path, "digest-a", max_bytes, model)
        small.begin_phase(model)
        small.record_step(model, optimizer, 5, 1, samples=8, seconds=1.0)
        small.flush()
        assert not small.active and not (tmp_path / JOURNAL_FILE).exists()


def _handed_off_phase(tmp_path, *, then_steps: int) -> tuple[nn.Module, PhaseJournal, list[torch.Tensor],
                                                               list[torch.Tensor], torch.optim.Optimizer]:
    """A life that trained round 5's phase (3 steps, handed off to its sync) and, with ``then_steps`` > 0, that many
    steps of round 6's (``[outer] overlap``: the next phase trains while round 5's sync is under way). Returns the
    policy, its journal, the progress of round 5's phase and of round 6's, and the optimizer."""
    model = _policy(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    journal = PhaseJournal(tmp_path, "digest-a", 1 << 20, model)
    journal.begin_phase(model)
    _train(model, optimizer, 3)
    journal.record_step(model, optimizer, 5, 3, samples=24, seconds=4.5)
    progress5 = journal.progress(model)
    journal.end_phase()
    journal.hand_off(5, progress5, optimizer, samples=24, seconds=4.5)
    journal.flush()
    assert (tmp_path / JOURNAL_FILE).exists()
    mid = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    journal.begin_phase(model)
    if then_steps:
        _train(model, optimizer, then_steps)
        journal.record_step(model, optimizer, 6, then_steps, samples=8 * then_steps, seconds=1.5 * then_steps)
        journal.flush()
    progress6 = [p.detach() - m for p, m in zip((p for p in model.parameters() if p.requires_grad), mid)]
    return model, journal, progress5, progress6, optimizer


def _next_life(tmp_path, round_: int, averaged_with_me) -> tuple[nn.Module, Resumed | None, list[torch.Tensor]]:
    theta = _policy(1)
    optimizer = torch.optim.AdamW([p for p in theta.parameters() if p.requires_grad], lr=0.01)
    journal = PhaseJournal(tmp_path, "digest-a", 1 << 20, theta)
    journal.begin_phase(theta)
    before = [p.detach().clone() for p in theta.parameters() if p.requires_grad]
    return theta, journal.resume(theta, optimizer, round_, averaged_with_me=averaged_with_me), before


def _moved_by(theta: nn.Module, before: list[torch.Tensor], *progress: list[torch.Tensor]) -> None:
    for i, (got, b) in enumerate(zip((p for p in theta.parameters() if p.requires_grad), before)):
        torch.testing.assert_close(got.detach(), b + sum(p[i] for p in progress), rtol=0, atol=1e-6)


def test_a_phase_handed_off_is_re_sent_by_the_next_life_when_its_round_was_averaged_without_it(tmp_path):
    """A life killed while round 5's sync was under way (overlapped: one step into round 6's phase): its next life,
    at round 6, applies both phases' progress when no group that averaged round 5 counted it (`resent_*` keys, both
    phases' episodes in the weight, only the cut phase's steps in this phase's), and only the cut phase's when one
    did: the counted phase is then recorded as landed (``landed_*`` keys: its seconds and episodes reached the model
    with no line of its life), out of the weight. Only the handed-off round is asked about."""
    _, _, progress5, progress6, _ = _handed_off_phase(tmp_path, then_steps=1)
    asked = []
    theta, resumed, before = _next_life(tmp_path, 6, lambda r: asked.append(r) or False)
    assert asked == [5]
    assert resumed == Resumed(6, 1, 8, 1.5, resent_round=5, resent_samples=24, resent_seconds=4.5)
    assert (resumed.total_samples, resumed.total_seconds) == (32, 6.0)
    assert resumed.record() == {"resumed_round": 6, "resumed_steps": 1, "resumed_samples": 8,
                                "resumed_inner_seconds": 1.5, "resent_round": 5, "resent_samples": 24,
                                "resent_inner_seconds": 4.5}
    _moved_by(theta, before, progress5, progress6)
    theta, resumed, before = _next_life(tmp_path, 6, lambda r: True)  # round 5's average counted this node
    assert resumed == Resumed(6, 1, 8, 1.5, landed_round=5, landed_samples=24, landed_seconds=4.5)
    assert (resumed.total_samples, resumed.total_seconds) == (8, 1.5)
    assert resumed.record() == {"resumed_round": 6, "resumed_steps": 1, "resumed_samples": 8,
                                "resumed_inner_seconds": 1.5, "landed_round": 5, "landed_samples": 24,
                                "landed_inner_seconds": 4.5}
    _moved_by(theta, before, progress6)


def test_a_phase_handed_off_waits_for_its_round_to_settle_and_leaves_once_it_settled(tmp_path):
    """Blocking sync: a life killed in round 5's barrier or all-reduce leaves only the handed-off phase. Its next
    life re-sends it at round 6 (nothing cut: no ``resumed_*`` keys), not at round 5 (the round is not settled: the
    group may yet count it) nor beyond ``journal_max_stale_rounds``. Once the sync settles in the life that handed
    it off (`settled`), the journal holds nothing of it; a round that is not the one handed off changes nothing."""
    model, journal, progress5, _, optimizer = _handed_off_phase(tmp_path, then_steps=0)
    theta, resumed, before = _next_life(tmp_path, 6, lambda r: False)
    assert resumed == Resumed(None, 0, 0, 0.0, resent_round=5, resent_samples=24, resent_seconds=4.5)
    assert resumed.record() == {"resent_round": 5, "resent_samples": 24, "resent_inner_seconds": 4.5}
    _moved_by(theta, before, progress5)
    for round_ in (5, 8):
        theta, resumed, before = _next_life(tmp_path, round_, lambda r: False)
        assert resumed is None, round_
        _moved_by(theta, before)
    # counted by round 5's group, nothing cut: recorded as landed, theta and the optimizer untouched
    theta, resumed, before = _next_life(tmp_path, 6, lambda r: True)
    assert resumed == Resumed(None, 0, 0, 0.0, landed_round=5, landed_samples=24, landed_seconds=4.5)
    assert (resumed.total_samples, resumed.total_seconds) == (0, 0.0)
    _moved_by(theta, before)
    journal.settled(4)
    assert (tmp_path / JOURNAL_FILE).exists()
    journal.settled(5)
    assert not (tmp_path / JOURNAL_FILE).exists()
    journal.record_step(model, optimizer, 6, 1, samples=8, seconds=1.0)  # the next phase's steps: no hand-off in it
    journal.flush()
    assert torch.load(tmp_path / JOURNAL_FILE, weights_only=True)["handed_off"] is None
