"""``python -m engine_agent.manifest``: the same command as ``weightroll manifest``."""

from engine_agent.manifest.cli import main

raise SystemExit(main())
