"""A tiny calculator package (the agentbox demo's sample repo)."""

from calc.core import add, subtract

__all__ = ["add", "subtract"]
