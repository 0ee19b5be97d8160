"""agentbox.guest."""
