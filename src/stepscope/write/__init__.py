"""The write pipeline: recorded events → TracePackets (``encoder``) → per-file sequences, tracks
and compression (``sink``) → the writer and I/O threads (``pipeline``), with ``flush`` and
``shutdown`` passed down the chain."""
