"""Data-movement collectives (gathers, scatters, all-to-all) and their exact transposes."""

__all__: list[str] = []
