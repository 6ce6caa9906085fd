"""The HTTP surface: ``create_app`` (``app``), the admin listener and its guards, basic auth, the
request-header guard, the ``/status`` document and the status page (``static/``).
"""
