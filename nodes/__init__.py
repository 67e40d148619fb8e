"""The `composer-node` command and the node life cycle (join, fetch config and state, train, leave)."""
