"""agentbox.collect."""
