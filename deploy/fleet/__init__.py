"""The fleet view on the operator's side: a collector from MQTT into SQLite/PostgreSQL, and a dashboard.

`deploy.fleet.db` is the store interface both share (see docs/fleet.md, "The fleet at a glance").
"""
