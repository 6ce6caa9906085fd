"""Examples built on the exporter's public surface (not part of the installed package)."""
