"""Stores: the SQLite metadata store and the content-addressed object store."""
