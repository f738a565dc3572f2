"""Bridges to frameworks that start the training processes (each imports its framework only when called)."""

from __future__ import annotations

__all__: list[str] = []
