"""SGLang integration: an HTTP adapter (`client.SGLangClient`), the step sequence of a colocated rollout
(`rollout.ColocatedRollout`), the worker-side custom weight loader that runs the colocated reader (`loader`),
and a STAND-IN server for tests (`standin`; SGLang itself is not installable here)."""
