"""Model definitions and llm.c checkpoint I/O."""
