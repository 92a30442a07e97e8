"""The `pyspice` command line (docs/design.md section 11)."""
