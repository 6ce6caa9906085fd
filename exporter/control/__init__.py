"""What runs against the fleet: the attach mode chosen from the config (``attach``), the poller,
the safe-to-resume gate, the admin actions and their verdicts (``actions``, ``reset``), the
counting wrapper every call goes through (``counted``) and the ``Exporter`` that wires them
(``runtime``).
"""
