"""OpenEnv environments of composer-diloco, one package each in OpenEnv's own layout."""
