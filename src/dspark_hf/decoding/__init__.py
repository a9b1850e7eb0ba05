"""One round, two drivers: the draft side of a round, the `generate()` adapter (R = 1), the engine (R rows), verification math and statistics."""
