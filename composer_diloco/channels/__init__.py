"""The loss channels of the composite inner loss beside TRL's GRPO; one channel = one module.

- `base`: the contract (`LossChannel`, `register_channel`, `registered_channels`) and `Counts`;
- `sdpo`: SDPO hint distillation at tool-error sites (arXiv 2601.20802), with `sdpo_hints` (the hint texts);
- `dpo`: trace-replay DPO (arXiv 2305.18290), with its jobs `dpo_pairs` (collection), `dpo_replay` (replay and
  scoring in the env), `dpo_teachers` (proposals from the env contract) and `dpo_pairing` (pure pairing rules);
- `losses`: the pure tensor functions (generalized JSD, sequence log-probs, DPO).

A module added here that defines a ``@register_channel`` class is picked up by every new trainer, the metrics line,
the round table and the plots (`base.registered_channels`).
"""
