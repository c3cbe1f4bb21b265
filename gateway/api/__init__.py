"""The HTTP edge (torch-free): request bodies (`protocol`), response bodies (`formats`) and
the FastAPI routes over a `Gateway` (`app`)."""
