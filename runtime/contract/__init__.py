"""The contract between the operator and the in-pod runtime: the only runtime code the operator imports.

- `events`: the step-event stream (schema, codec, the final record's termination message);
- `env`: the table of every `COLOCATE_*` variable (name, type, default, meaning, who reads it): the operator
  renders pod environments from it and `colocated.config.ColocateConfig.from_env` parses with it;
- `checkpoint`: a suspend at a step boundary: the operator's checkpoint request, the trainer's ACK and the
  step a resumed trainer continues after (meta-store keys and records).

It lives in the runtime's package (the operator image already ships `colocate_runtime`, whose own
`__init__` is empty) and imports only the standard library: no torch, no redis, no other runtime module
(`make lint` checks both directions).
"""
