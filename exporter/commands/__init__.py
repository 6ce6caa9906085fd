"""What a user runs: the command line (``cli``), ``serve`` (``service``), ``probe``, ``ctl`` and
``demo``. The only package that may use every other one.
"""
