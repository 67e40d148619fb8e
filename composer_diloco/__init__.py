"""composer-diloco: DiLoCo for agentic RL over a hivemind DHT.

One round, and where each step lives:

    rollout/   multi-turn tool episodes against OpenEnv servers (`rollout.episodes`, `rollout.mcp`), on a node's
               sessions (`rollout.sessions`) and tasks (`rollout.tasks`); what the core takes from an env package
               (`rollout.env_package`)
    inner/     H inner AdamW steps: TRL's GRPOTrainer (`inner.trainer`) on one step's data (`inner.step`), the
               composite loss = GRPO + the registered loss channels (`channels.sdpo`, `channels.dpo`, ...)
    outer/     pseudo-gradient -> barrier -> all-reduce -> outer step -> load theta (`outer.peer.DiLoCoPeer.sync`),
               with the all-reduce (`outer.averaging`), the outer optimizer (`outer.global_model`) and the recovery
               of a failed round (`outer.recovery`)

Beside them: `policy` (the embedded default and model loading), `config` (the run config), `checkpoint`,
`metrics`, `faults` (named fault points for tests), `lifecycle` and `reaper` (processes). The node and coordinator
life cycles live in the top-level `nodes` and `coordinator` packages.
"""

__version__ = "0.1.0"
