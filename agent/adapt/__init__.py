"""Dynamic model adjustment: a family of variants, a pure policy, and a controller that hot-swaps between them."""
