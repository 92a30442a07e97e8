"""The `pyspice` command line (DESIGN section 11)."""
