"""Which models stay resident under a memory limit, loaded on demand and evicted by measured
bytes."""
