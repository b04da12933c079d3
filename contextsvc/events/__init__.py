"""Event buses: in-process (single replica) and PostgreSQL LISTEN/NOTIFY (many replicas)."""
