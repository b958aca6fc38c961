"""The model the agent serves: the slots (`slots`: the active model, the one kept for an instant rollback, and the
lock every change of them takes). A package of its own because deployments and adaptation both change the slots
and the frame path only hands over between batches: none of them may own what the others change."""
