"""The inner half of a DiLoCo round: H optimizer steps on one node, from theta.

- `trainer`: TRL's `GRPOTrainer` fed by multi-turn episodes (the one adapter over TRL);
- `collator`: a step's episodes -> the extra loss channels' tensors;
- `composite`: the composite loss's extra channels.
"""
