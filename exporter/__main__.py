"""``python -m exporter`` runs the same CLI as the ``vllm-dp-exporter`` console script."""

from exporter.commands.cli import main

raise SystemExit(main())
