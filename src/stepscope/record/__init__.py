"""The hot path: events recorded as raw int64 words (``recorder``; its C twin ``stepscope._fast``,
chosen once in ``recorder``), drained by the writer. Imports nothing above the format leaves."""
