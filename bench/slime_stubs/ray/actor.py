"""See ray/__init__.py."""


class ActorHandle:
    pass
