"""What runs against the fleet: the attach mode chosen from the config (``attach``), the poller,
the safe-to-resume gate, the admin actions (their requests: ``parsing``; their specs and
fan-outs: ``actions``; their verdicts and answers: ``verdicts``; the one path that runs them:
``runner``), the counting wrapper every call goes through (``counted``) and the ``Exporter``
that wires them (``runtime``).
"""
