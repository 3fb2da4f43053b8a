"""Model frontends: MODEL specs to torch modules and example inputs (``models``), a module to
tapml's graph (``capture``), and ``.pt2`` archives read as data (``pt2``)."""
