"""agentbox.launcher."""
