"""OpenEnv environments of composer-diloco, one package each in OpenEnv's own layout.

Shared by the packages: `envs.protocol` (the typed tool-call protocol: action, observation, state, client, which
each package's ``models.py`` and ``client.py`` subclass), `envs.schema` (tool schemas in OpenAI function format) and
`envs.demonstration` (the scripted demonstrations' type). What the trainer takes from a package is the env contract
of ``composer_diloco/rollout/env_package.py``.
"""
