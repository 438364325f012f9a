"""Plain-torch communication helpers: byte accounting, process groups, tree reduce."""

__all__: list[str] = []
