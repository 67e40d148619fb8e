"""The loss channels of the composite inner loss beside TRL's GRPO; one channel = one module.

- `base`: the contract (`LossChannel`, `register_channel`, `registered_channels`), `Counts` and `pad_rows`;
- `settings`: a channel's ``[loss]`` keys (`ChannelSettings`, declared in the channel's module), which the run config
  checks and publishes through it (torch-free to import);
- `sdpo`: SDPO hint distillation at tool-error sites (arXiv 2601.20802), with `sdpo_sites` (sites and their rows)
  and `sdpo_verify` (replayed verification of the hinted teacher);
- `dpo`: trace-replay DPO (arXiv 2305.18290), with its jobs `dpo_pairs` (collection), `dpo_teachers` (proposals
  from the env contract), `dpo_pairing` (pure pairing rules) and `dpo_rows` (padded rows, reference log-probs);
- shared by both, naming neither: `hints` (hint texts from a tool error) and `replay` (replaying an episode in its
  env and scoring a candidate call there);
- `losses`: the pure tensor functions (generalized JSD, sequence log-probs, DPO).

A module added here that defines a ``@register_channel`` class is picked up by every new trainer, the metrics line,
the round table, the plots, the run config's ``[loss]`` keys and the memory plan (`base.registered_channels`).
"""
