"""agentbox.gateway."""
