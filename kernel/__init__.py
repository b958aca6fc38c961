"""The kernel every wing shares (engines, agent, deploy): the error types and the one catalogue of their codes, the
plugin registry, atomic file writes. It is a package of its own, below the engines, so that a camera source or a
deploy command can raise an `EdgeError` or register a plugin without depending on the engine wing; it imports
nothing of the project (pyproject.toml's layers contract)."""
