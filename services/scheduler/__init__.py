"""The scheduler: tag-based resource registry, placement policies (colocated,
disaggregated, seamless) and host reassignment. Not built yet; see docs/architecture.md
"Known gaps"."""
