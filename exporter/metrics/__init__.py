"""Prometheus output: the catalog of every series (``catalog``), the counters behind them
(``stats``), rows per scrape from one snapshot (``families``), the lean text encoder
(``exposition``) and content negotiation.
"""
