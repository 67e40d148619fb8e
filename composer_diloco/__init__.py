"""composer-diloco: DiLoCo for agentic RL over a hivemind DHT.

One round, and the module that does each step:
    rollouts (`rollout`) -> GRPO batch (`trainer`) -> H inner AdamW steps (`trainer`)
    -> pseudo-gradient, all-reduce, outer Nesterov step (`diloco`, `averaging`, `outer`)
The node and coordinator life cycles live in the top-level `nodes` and `coordinator` packages.
"""

__version__ = "0.1.0"
