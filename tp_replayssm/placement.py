"""PLACEHOLDER (helper B replaces this): PlacementError and the collective check."""
from __future__ import annotations


class PlacementError(ValueError):
    pass
