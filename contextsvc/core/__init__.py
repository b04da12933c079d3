"""The pure domain: messages, sessions, turns, legal views. Imports no I/O libraries."""
