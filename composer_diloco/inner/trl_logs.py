"""TRL's own step metrics in the run's tracker (``[report]``): what `GRPOTrainer` logs each inner step, per round.

TRL logs each inner step's metrics through the Trainer's ``on_log`` (``loss``, ``grad_norm``, ``reward``,
``reward_std``, ``entropy``, ``clip_ratio/...``, ``completions/mean_length``, ...). Its own ``report_to`` is not used
for the tracker: trackio and wandb keep one run per process, and TRL's callbacks would open a second one in the
node's process (and finish ours at the end of training), and log with steps of their own that break the round axis
(wandb takes no step that goes back). Instead this callback keeps the numbers TRL logs and, once a round's line is
written, sends their means over the round's steps as ``trl/<name>`` at the round's step, in the peer's run.
"""

from __future__ import annotations

import math
from collections import defaultdict

from transformers import TrainerCallback

from composer_diloco.report import Reporter


class TrlLogsToTracker(TrainerCallback):
    """Sends TRL's per-step logs, averaged per round, to ``reporter`` (`Reporter.log_extra`).

    A round's steps are those logged since the previous round's line: the step in which a round's line is written
    (`Reporter.last_round` changes) closes it once its own log arrives (the Trainer logs a step after its
    ``on_step_end``). With ``[outer] overlap`` a round's line is written a round late, so its means span the steps
    logged until then. Non-numeric and non-finite values are left out.

    Args:
        reporter: the peer's `Reporter` (an inactive one: nothing is kept).
    """

    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self._seen_round = reporter.last_round
        self._closes: dict[int, int] = {}  # global step -> the round whose line was written in that step
        self._values: dict[str, list[float]] = defaultdict(list)

    def on_step_end(self, args, state, control, **kwargs):
        """After the round callback: a round line written during this step closes that round at this step."""
        if self.reporter.last_round != self._seen_round:
            self._seen_round = self.reporter.last_round
            self._closes[state.global_step] = self._seen_round
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Keep this step's numbers; at a round's closing step, send their means over the round's steps."""
        if not self.reporter.active:
            return control
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._values[key].append(float(value))
        round_ = self._closes.pop(state.global_step, None)
        if round_ is not None and self._values:
            self.reporter.log_extra({f"trl/{k}": sum(v) / len(v) for k, v in self._values.items()}, round_)
            self._values.clear()
        return control


__all__ = ["TrlLogsToTracker"]
