"""`spec-batch` commands of this area (registered on the group in _group.py)."""
from ._group import main  # noqa: F401
