"""The session facade and what it owns: hooks for the producers, the exit/signal lifecycle.

``session.Session`` is the facade the public API and the producers use; it composes the track
registry (``tracks``), the emitters (``emitter``), the drop accounting (``drops``) and the write
pipeline (``stepscope.write``). ``hooks`` is how producers reach the core without being
imported by it. See docs/internals.md for the layers.
"""
