"""Runtime: what runs per call of a rewritten graph (runners, mask checks, nested compiles)."""
