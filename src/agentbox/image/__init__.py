"""agentbox.image."""
