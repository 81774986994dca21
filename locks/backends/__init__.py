"""Lock backends, one module each: Redis (one node) and in-memory (for unit tests)."""
