"""The analysis' command-line subcommands, added to ``stepscope``'s parser by ``stepscope.cli``.

What the files share (``common``): the engine arguments (``--engine``, ``--trace-processor``),
opening traces or a run directory by the role of its files, and one-line errors.

* ``summary`` -- ``stepscope summary PATH...``: the summary tables.
* ``sql``     -- ``stepscope sql PATH... "SELECT ..."`` and ``stepscope export-csv``.

Each module exports ``add_parsers(subparsers)``.
"""
