"""Simulated vLLM engines (and API servers) for tests, demos and benchmarks."""
