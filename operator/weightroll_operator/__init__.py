"""weightroll's Kubernetes operator (kopf): rolls verified in-place weight updates through pods."""

__all__: list[str] = []
