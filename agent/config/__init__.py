"""The agent's one config tree (`tree`: TOML + `EDGE_AGENT_*`) and its errors mapped to field and line (`errors`).
It gathers the wings' own config models, so it sits above them: only the composition root and the command line
read the tree, and a wing is handed its own section, whose model lives in the wing's package (pyproject.toml's
agent layers contract)."""
