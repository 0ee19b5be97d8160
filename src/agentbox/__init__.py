"""agentbox: run AI coding agents in sandboxes that assume the worst.

The public surface is small; implementation lives in subpackages.
"""

from agentbox.boxfile import Boxfile, load_boxfile
from agentbox.config import Settings, load_settings
from agentbox.errors import AgentboxError

__version__ = "0.1.0"

__all__ = ["AgentboxError", "Boxfile", "Settings", "__version__", "load_boxfile", "load_settings"]
