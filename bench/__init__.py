"""Benchmarks of the exporter against simulated engines in separate processes (``make bench``).

``python -m bench.run`` writes ``docs/benchmarks/README.md``; see ``bench/run.py`` for the options.
"""
