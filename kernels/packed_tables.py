"""The layout the table-batched embedding ops take (many tables in one flat buffer, keyed bags):
search_space.packed_tables, where the ops' problems declare it, as the kernel library's API."""

from search_space.packed_tables import Layout

__all__ = ["Layout"]
