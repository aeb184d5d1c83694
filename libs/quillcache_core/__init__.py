"""Shared core of QuillCache: data model, hashing, index, planner, guard, registry."""

__version__ = "0.1.0"
