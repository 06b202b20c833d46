"""The ``weightroll.io/v1alpha1`` API: pydantic models (source of truth) and the CRD generator."""

__all__: list[str] = []
