"""Rollouts: multi-turn tool episodes played against OpenEnv servers.

- `episodes`: `Episode`, `Turn`, the `EnvSession` protocol, the turn rules and the sampler;
- `play`: `play_episodes`, a step's episodes with the batched engine or `continuous`'s;
- `mcp`: sessions of OpenEnv MCP tool servers, and telling them from typed envs;
- `sessions`: a node's sessions over its env URLs, within each server's capacity;
- `tasks`: tasks from a dataset (``[tasks]``, TRL's ``reset(**row)``) and their split between nodes;
- `chat`: rendering turns and parsing tool calls;
- `episode_tokens`: token spans of a played episode;
- `env_process`: starting and probing env server processes;
- `openenv_import`: importing OpenEnv without its gradio web UI (~3.5 s of CPU per process);
- `env_package`: the env contract (what the core takes from an env package, found from ``[env] server_module``).
"""
