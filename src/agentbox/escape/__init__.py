"""agentbox.escape."""
