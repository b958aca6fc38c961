"""The device's own storage: the SQLite state store and its schema (`state`, `schema`), the health of its writes
(`health`) and what the agent sheds when the disk is full (`reclaim`). Below every wing that records state, so
the wings share one store without importing each other."""
