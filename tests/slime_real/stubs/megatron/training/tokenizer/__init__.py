"""Stand-in package (see megatron/training/__init__.py)."""
