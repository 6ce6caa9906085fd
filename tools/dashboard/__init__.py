"""Building blocks and rows of the Grafana dashboard (see tools/gen_dashboard.py)."""
