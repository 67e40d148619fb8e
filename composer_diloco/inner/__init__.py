"""The inner half of a DiLoCo round: H optimizer steps on one node, from theta.

- `trainer`: TRL's `GRPOTrainer` fed by multi-turn episodes, plus the registered loss channels (the one adapter
  over TRL);
- `step`: one step's data (`StepBatch`) and one round's statistics (`RoundStats`, the node's metrics line);
"""
