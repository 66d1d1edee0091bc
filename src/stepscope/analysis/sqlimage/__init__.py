"""The SQLite image writer: numpy columns -> an SQLite database file image."""
