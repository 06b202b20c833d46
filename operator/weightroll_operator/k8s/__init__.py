"""The only callers of the Kubernetes API (house rule 1). See :mod:`.client`."""

__all__: list[str] = []
