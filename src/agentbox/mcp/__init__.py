"""agentbox.mcp."""
