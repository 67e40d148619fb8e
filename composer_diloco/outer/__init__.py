"""The outer half of a DiLoCo round, after a node's H inner steps: pseudo-gradient -> barrier -> all-reduce ->
outer step -> load theta.

- `peer`: one peer's round protocol (`DiLoCoPeer.sync`), the entry point of this half;
- `recovery`: what a peer does when a round fails it (`RoundFailed`), and how a peer joins a swarm underway;
- `global_model`: theta and the outer optimizer (DiLoCo's OuterOpt: any torch.optim optimizer the config names);
- `averaging`: the weighted all-reduce over hivemind, with identical bytes on every peer;
- `screening`: which contributions of a group are dropped (NaN/Inf, norm outliers);
- `compression`: the all-reduce codecs (none, fp16, int8);
- `swarm`: the DHT records of a run (config, heartbeats, rounds);
- `auth`: closed runs (a shared secret); `secret`: where the secret is read from, without hivemind;
- `address_form`: the form of ``--peer`` / ``--listen`` / ``--announce``, checked without hivemind.
"""
