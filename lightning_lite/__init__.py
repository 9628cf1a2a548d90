"""lightning-lite: harnessed agentic RL in a few thousand readable lines."""
