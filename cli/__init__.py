"""The ``kvtier`` command line: admin commands, the demo and the bench runner."""
