"""The analysis' command-line subcommands: ``stepscope summary``, ``sql`` and ``export-csv``."""
