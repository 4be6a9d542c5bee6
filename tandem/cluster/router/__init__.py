"""The router process: the OpenAI-compatible entry point in front of the instances."""
