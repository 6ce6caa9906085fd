"""``ServeConfig`` from flags, environment and config file (``settings``), the bounds and type
checks of every setting (``rules``) and the ``--web-config-file`` loader (``webconfig``).
"""
