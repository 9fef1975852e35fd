"""The commands of ``gradequiv``, one module each: ``check``, ``mutants``, ``profiling``
(``gradequiv profile``), ``distributed`` and ``render`` (``gradequiv report``). Each has
``run(...) -> exit code``; the CLI imports only the one chosen."""
