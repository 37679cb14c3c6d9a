"""The ``zeroplan`` command line."""
