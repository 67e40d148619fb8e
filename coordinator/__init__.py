"""The `composer-coordinator` command: `start` (DHT bootstrap, canonical model, checkpoints) and `simulate`."""
