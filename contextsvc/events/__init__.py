"""Event buses: in-process (single replica). The PostgreSQL bus lives with the rest of the
PostgreSQL adapter in ``contextsvc.stores.postgres``."""
