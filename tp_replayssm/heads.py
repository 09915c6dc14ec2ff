"""PLACEHOLDER (helper A replaces this): KDAHeads and the TP sharding rule."""
from __future__ import annotations


class KDAHeads:  # placeholder
    pass
