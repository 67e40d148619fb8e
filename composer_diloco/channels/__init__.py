"""The loss channels of the composite inner loss beside TRL's GRPO: SDPO hint distillation and trace-replay DPO.

- `losses`: the pure tensor functions (generalized JSD, sequence log-probs, DPO);
- `sdpo_hints`: the hint text for each tool error (the SDPO teacher's context);
- `dpo_pairs`: chosen/rejected pairs from replaying a step's episodes.
"""
