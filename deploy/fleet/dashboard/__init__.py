"""The fleet web dashboard (`edge-deploy dashboard`): a read-only view of the fleet store.

`app.create_app` builds the Starlette app; `server.serve` runs it with uvicorn; `queries` holds the SQL.
"""
