"""Shadow deployments: a gated candidate runs beside the serving model on a share of live frames, and is
promoted on how well it agrees with it (docs/deployments.md#shadow-deployments)."""
