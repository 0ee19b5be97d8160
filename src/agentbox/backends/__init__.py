"""agentbox.backends."""
