"""Import-only stand-in for `ray` on the lent GPU machine (bench/slime_compare.py), which cannot carry Ray's
80 MB wheel: slime's update_weight_from_tensor module imports `ray`, `ray.ObjectRef` and
`ray.actor.ActorHandle` at module level, and its `_send_to_colocated_engine` only calls
`handle.update_weights_from_tensor.remote(...)`; the bench's handle answers `.remote()` with a finished
result, which `get` returns. Here (CPU) the real Ray of scripts/slime-env.sh is used instead."""


class ObjectRef:
    def __init__(self, value):
        self.value = value


def get(refs):
    if isinstance(refs, list):
        return [get(r) for r in refs]
    return refs.value if isinstance(refs, ObjectRef) else refs


def put(value):
    return ObjectRef(value)
