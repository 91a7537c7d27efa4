"""Starting and stopping a ``kvtierd`` process from Python
(:mod:`~kvtier.launch.daemon_process`), for the demo, the benchmarks and the tests."""
